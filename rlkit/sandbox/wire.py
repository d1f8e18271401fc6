"""What both of a code reward's sandboxed programs (`rlkit.sandbox.runners`) start with: their
limits, their throwaway uid, private copies of stdin and stdout, the audit hook, and the wire
format of what crosses between them: plain data by exact type (`enc` / `dec`), or a reference to
an object that stays on the sender's side."""

from __future__ import annotations

# Both programs: stdin line 1 is JSON {limits, uid, audit, ...}; `req` / `res` are private copies of
# stdin / stdout; fds 0, 1 and 2 point at /dev/null before any test or candidate code runs.
PREAMBLE = r"""
import builtins, collections, io, json, math, os, resource, sys
req = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
cfg = json.loads(req.readline())
for name, v in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (v, v))
if cfg.get("reroot"):  # the throwaway uid may not pass the folders above the interpreter: keep them open
    roots = [(p, "/proc/self/fd/%d" % os.open(p, os.O_RDONLY | os.O_DIRECTORY)) for p in sys.path if os.path.isdir(p)]
    sys.path[:] = [fd for _, fd in roots]
    for m in list(sys.modules.values()):  # packages imported already: their submodules too
        if type(getattr(m, "__path__", None)) is list:
            m.__path__ = [next((fd + q[len(p):] for p, fd in roots if q.startswith(p + "/")), q) for q in m.__path__]
    sys.path_importer_cache.clear()
if cfg.get("filter"):
    import ctypes
if cfg["uid"] is not None:
    u = cfg["uid"]
    os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
if cfg.get("filter"):  # "process" mode: the seccomp filter bubblewrap loads in the other
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    bpf = ctypes.create_string_buffer(bytes.fromhex(cfg["filter"]))
    prog = Prog(len(cfg["filter"]) // 16, ctypes.cast(bpf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        raise SystemExit("sandbox: the seccomp filter did not load: " + os.strerror(ctypes.get_errno()))
res = os.fdopen(os.dup(1), "w", encoding="utf-8")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
sys.stdin, sys.stdout, sys.stderr = io.StringIO(""), io.StringIO(), io.StringIO()
def send(obj):
    res.write(json.dumps(obj) + "\n"); res.flush()
send({"ready": True})
cwd = os.path.realpath(os.getcwd()) + os.sep
def inside(p):
    try:
        return os.path.realpath(os.fsdecode(p)).startswith(cwd)
    except Exception:
        return False
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
BLOCK = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
         "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
         "os.chown", "os.setuid", "sys.addaudithook", "pty.spawn", "os.startfile"}
PATHS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.link", "os.symlink",
         "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
def hook(event, args):
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        if isinstance(path, int):
            return
        w = (isinstance(mode, str) and any(m in mode for m in "wax+")) or (isinstance(flags, int) and flags & WRITE)
        if w and not inside(path):
            raise PermissionError("sandbox: writing outside the working directory")
    elif event in BLOCK:
        raise PermissionError("sandbox: " + event + " is not allowed")
    elif event in PATHS and args and isinstance(args[0], (str, bytes, os.PathLike)) and not inside(args[0]):
        raise PermissionError("sandbox: " + event + " outside the working directory")
# Plain data, by exact type: what crosses between the two programs (`ref`: an object kept on the
# sender's side; `cb`: a function of the test's, which the candidate may only call).
SAFE = 1 << 53
SEQS = {"tuple": tuple, "set": set, "frozenset": frozenset, "deque": collections.deque}
MAPS = {"dict": dict, "OrderedDict": collections.OrderedDict, "Counter": lambda pairs: collections.Counter(dict(pairs)),
        "defaultdict": lambda pairs: collections.defaultdict(None, pairs)}
PLAIN_BASES = {str: str.__str__, int: int.__index__, float: float.__float__, complex: complex,
               bytes: bytes, bytearray: bytearray, list: list, tuple: tuple, set: set, frozenset: frozenset,
               dict: dict, collections.deque: collections.deque}
NAMEDTUPLES = {}
def enc(v, keep, depth=0):
    t = type(v)
    if depth > 64:
        raise ValueError("nested too deep")
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return v if -SAFE < v < SAFE else {"int": hex(v)}
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is list:
        return [enc(x, keep, depth + 1) for x in v]
    if t.__name__ in SEQS and SEQS[t.__name__] is t:
        return {t.__name__: [enc(x, keep, depth + 1) for x in v]}
    if t in (dict, collections.OrderedDict, collections.Counter, collections.defaultdict):
        return {t.__name__: [[enc(k, keep, depth + 1), enc(x, keep, depth + 1)] for k, x in v.items()]}
    if t in (bytes, bytearray):
        return {t.__name__: v.hex()}
    if t is complex:
        return {"complex": [enc(v.real, keep), enc(v.imag, keep)]}
    if t is getattr(sys.modules.get("fractions"), "Fraction", None):  # loaded only when a value needs it
        return {"Fraction": [enc(v.numerator, keep), enc(v.denominator, keep)]}
    if t is getattr(sys.modules.get("decimal"), "Decimal", None):
        return {"Decimal": str(v)}
    base = next((b for b in PLAIN_BASES if isinstance(v, b)), None)
    if base is not None:  # a subclass of plain data travels as that data: its own methods stay behind
        fields = getattr(t, "_fields", None) if base is tuple else None
        if type(fields) is tuple and 0 < len(fields) <= 64 and all(type(f) is str for f in fields):
            return {"namedtuple": [list(fields), [enc(x, keep, depth + 1) for x in tuple.__iter__(v)]]}
        return enc(PLAIN_BASES[base](v), keep, depth + 1)
    return keep(v)
def dec(v, peer, depth=0):
    t = type(v)
    if depth > 64:
        raise ValueError("nested too deep")
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [dec(x, peer, depth + 1) for x in v]
    if t is not dict or len(v) != 1:
        raise ValueError("not plain data")
    (tag, x), = v.items()
    if tag == "int" and type(x) is str:
        return int(x, 16)
    if tag == "float" and x in ("nan", "inf", "-inf"):
        return float(x)
    if tag in SEQS and type(x) is list:
        return SEQS[tag](dec(i, peer, depth + 1) for i in x)
    if tag in MAPS and type(x) is list and all(type(p) is list and len(p) == 2 for p in x):
        return MAPS[tag]([(dec(k, peer, depth + 1), dec(i, peer, depth + 1)) for k, i in x])
    if tag in ("bytes", "bytearray") and type(x) is str:
        return (bytes if tag == "bytes" else bytearray).fromhex(x)
    if tag == "complex" and type(x) is list and len(x) == 2:
        return complex(*(float(dec(i, peer)) for i in x))
    if tag == "Fraction" and type(x) is list and len(x) == 2 and all(type(dec(i, peer)) is int for i in x):
        import fractions
        return fractions.Fraction(*(dec(i, peer) for i in x))
    if tag == "namedtuple" and type(x) is list and len(x) == 2 and type(x[0]) is list and type(x[1]) is list \
            and len(x[0]) == len(x[1]) and all(type(f) is str and f.isidentifier() for f in x[0]):
        key = tuple(x[0])
        if key not in NAMEDTUPLES:
            NAMEDTUPLES[key] = collections.namedtuple("Returned", key)
        return NAMEDTUPLES[key](*(dec(i, peer, depth + 1) for i in x[1]))
    if tag == "Decimal" and type(x) is str and len(x) < 4096:
        import decimal
        return decimal.Decimal(x)
    return peer(tag, x)
def error_name(e):
    return type(e).__name__
"""

