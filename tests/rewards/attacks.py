"""Adversarial candidates for the code reward's sandbox, each with the traps that tell whether it got out.

Run in the test process (as root) and, through ``python3 -m tests.rewards.attacks AUDIT ISOLATION NAME...``
under an ordinary user, as that user: each scenario sets up what a driver has (a secret in its
environment and in a file it can read, TCP, Unix and abstract sockets listening on loopback, another
process of its own, its checkout), runs one candidate through `rewards.code.run_tests` and reports
JSON: the score, and every way the candidate got out (an empty list when it was contained).
Standard library only: the ordinary user runs it with the system's Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "s3cret-" + uuid.uuid4().hex
# Every candidate answers a question whose answer only a breach gives, so a breach scores.
ATTACKS = {
    # forging the verdict
    "eq_always_true": ("class Yes:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
                       "def solve(): return Yes()", ["assert solve() == {secret!r}"]),
    "builtin_subclass": ("class S(str):\n    def __eq__(self, other): return True\n    __hash__ = str.__hash__\n"
                         "def solve(): return S('x')", ["assert solve() == {secret!r}"]),
    "patched_builtins": ("import builtins, operator, math\nbuiltins.abs = lambda x: 0\n"
                         "builtins.sorted = lambda *a, **k: [1]\n"
                         "math.isclose = lambda *a, **k: True\noperator.eq = lambda a, b: True\n"
                         "def solve(): return 1.0",
                         ["assert abs(solve() - 7.0) < 1e-9", "assert math.isclose(solve(), 7.0)",
                          "assert sorted([solve()]) == [7.0]"]),
    "forged_result_lines": ("import os\nfor fd in range(64):\n    for i in range(8):\n        try:\n"
                            "            os.write(fd, ('{{\"i\": %d, \"v\": true}}\\n'"
                            "'{{\"i\": %d, \"out\": \"42\"}}\\n' % (i, i)).encode())\n"
                            "        except OSError:\n            pass\nos._exit(0)",
                            ["assert solve() == {secret!r}", "assert solve(1) == {secret!r}"]),
    # the candidate's own object asked what the test expects of plain data: the expected value as the
    # argument of a method call on it, which answers yes (and a str subclass whose startswith lies)
    "method_calls": ("class Yes:\n    def __getattr__(self, name):\n"
                     "        return lambda *a, **k: {{'find': 0, 'index': 0, 'rfind': 0, 'rindex': 0, 'count': 1,"
                     " 'compare': 0, 'symmetric_difference': set(), 'removeprefix': ''}}.get(name, True)\n"
                     "def solve(): return Yes()",
                     ["assert solve().startswith({secret!r})", "assert solve().endswith({secret!r})",
                      "assert solve().issubset({{{secret!r}}})", "assert solve().issuperset({{{secret!r}}})",
                      "assert solve().count({secret!r}) == 1", "assert solve().find({secret!r}) == 0",
                      "assert solve().isclose({secret_int})", "assert solve().compare({secret_int}) == 0",
                      "assert solve().symmetric_difference({{{secret!r}}}) == set()",
                      "assert solve().removeprefix({secret!r}) == ''"]),
    "lying_str_subclass": ("class S(str):\n    def startswith(self, *a): return True\n"
                           "    def __eq__(self, other): return True\n    __hash__ = str.__hash__\n"
                           "def solve(): return S('x')",
                           ["assert solve().startswith({secret!r})", "assert solve() == {secret!r}"]),
    "early_exit": ("import sys\nsys.exit(0)", ["assert solve() == {secret!r}"]),
    # the expected side within reach: a test whose expected value sits in a generator, a method call
    # or a helper the old split sent whole to the candidate; the candidate searches all it can reach
    "expected_in_reach": ("import gc, json, re, sys\ndef solve(*args):\n"
                          "    for o in gc.get_objects() + [sys.modules['__main__'].__dict__]:\n        try:\n"
                          "            found = re.search('s3' + 'cret-[0-9a-f]{{32}}', json.dumps(o, default=repr))\n"
                          "        except Exception:\n            continue\n"
                          "        if found:\n            return found.group(0)\n",
                          ["assert solve() == {secret!r}", "assert all(solve(x) == {secret!r} for x in range(3))",
                           "assert solve().startswith({secret!r})", "assert operator.eq(solve(), {secret!r})"]),
    "shadowed_helpers": ("import builtins, math, operator\nbuiltins.all = builtins.any = lambda *a: True\n"
                         "operator.eq = operator.contains = math.isclose = lambda *a, **k: True\n"
                         "def isclose(*a, **k): return True\ndef solve(*args): return 0",
                         ["assert all(solve(x) == {secret!r} for x in range(3))",
                          "assert any([solve(x) == {secret!r} for x in range(3)])",
                          "assert operator.eq(solve(), {secret!r})", "assert operator.contains([solve()], {secret!r})",
                          "assert isclose(solve(), {secret_int})", "assert math.isclose(solve(), {secret_int})"]),
    # reading what the driver has
    "env_secret": ("import os\ndef solve(): return os.environ.get('RLKIT_ATTACK_SECRET')",
                   ["assert solve() == {secret!r}"]),
    "file_secret": ("def solve():\n    return open({secret_file!r}).read()", ["assert solve() == {secret!r}"]),
    "proc_environ": ("import os\ndef solve():\n    for p in os.listdir('/proc'):\n        try:\n"
                     "            data = open('/proc/%s/environ' % p, 'rb').read()\n        except OSError:\n"
                     "            continue\n        if b'RLKIT_ATTACK_SECRET=' in data:\n"
                     "            return data.split(b'RLKIT_ATTACK_SECRET=')[1].split(b'\\0')[0].decode()",
                     ["assert solve() == {secret!r}"]),
    # the process that runs the candidate (its parent: the driver's side of the sample, which holds the
    # tests and the pipes the verdicts come back on), through /proc: its memory, and its pipes written to
    "parent_memory": ("import os, re\ndef solve():\n    pid = os.getppid()\n    try:\n"
                      "        maps = open('/proc/%d/maps' % pid).read().splitlines()\n"
                      "        mem = open('/proc/%d/mem' % pid, 'rb', 0)\n    except OSError:\n        return None\n"
                      "    for line in maps:\n        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
                      "        if 'r' not in line.split()[1] or hi - lo > 1 << 28:\n            continue\n"
                      "        try:\n            mem.seek(lo); data = mem.read(hi - lo)\n        except OSError:\n"
                      "            continue\n        found = re.search(b's3' + b'cret-[0-9a-f]{{32}}', data)\n"
                      "        if found:\n            return found.group(0).decode()",
                      ["assert solve() == {secret!r}"]),
    "parent_pipes": ("import os\nforged = b'{{\"ready\": true}}\\n{{\"i\": 0, \"ok\": true}}\\n{{\"done\": true}}\\n'\n"
                     "fds = '/proc/%d/fd' % os.getppid()\ntry:\n    names = os.listdir(fds)\nexcept OSError:\n"
                     "    names = []\nfor n in names:\n    try:\n"
                     "        if os.readlink(fds + '/' + n).startswith('pipe:'):\n"
                     "            fd = os.open(fds + '/' + n, os.O_WRONLY | os.O_NONBLOCK)\n"
                     "            os.write(fd, forged); os.close(fd)\n    except OSError:\n        pass\n"
                     "def solve(): return 0",
                     ["assert solve() == {secret!r}"]),
    "read_checkout": ("def solve():\n    return len(open({checkout_file!r}).read())",
                      ["assert solve() == {checkout_len}"]),
    # reaching out
    # (the shared temporary folders are the sandbox's own: a write there scores nothing, and must not
    # reach the driver's; the driver's folders must not be writable at all)
    "write_outside": ("import os\ndef solve():\n    n = 0\n    for p in {outside!r}:\n        try:\n"
                      "            open(p, 'w').write('pwned'); n += p in {host_only!r}\n        except OSError:\n"
                      "            pass\n    return n", ["assert solve() > 0"]),
    "tcp_loopback": ("import socket\ndef solve():\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                     "    s.sendall(b'pwned')\n    return 'connected'", ["assert solve() == 'connected'"]),
    "unix_sockets": ("import socket\ndef solve():\n    n = 0\n    for addr in ({unix_path!r}, '\\0' + {abstract!r}):\n"
                     "        try:\n            s = socket.socket(socket.AF_UNIX); s.connect(addr)\n"
                     "            s.sendall(b'pwned'); n += 1\n"
                     "        except OSError:\n            pass\n    return n", ["assert solve() > 0"]),
    "signals": ("import os, signal\ndef solve():\n    for pid in ({victim}, {driver}, -1):\n        try:\n"
                "            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n    return 0",
                ["assert solve() == 1"]),
    # the kernel's own interfaces (x86_64 syscall numbers): the driver's session keyring (a secret
    # the scenario puts there; keys planted there or in the sandbox user's keyring), a tmpfs mounted
    # in a nested user namespace (memory past every limit), tracing and eBPF
    "keyring": ("import ctypes\ndef solve():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
                "    for ring in (-3, -4, -5):\n        libc.syscall(248, b'user', b'rlkit-planted', b'x', 1, ring)\n"
                "    key = libc.syscall(250, 10, -3, b'user', b'rlkit-attack', 0)\n"
                "    buf = ctypes.create_string_buffer(256)\n"
                "    n = libc.syscall(250, 11, key, buf, 256) if key > 0 else -1\n"
                "    return buf.raw[:n].decode() if n > 0 else None", ["assert solve() == {secret!r}"]),
    "nested_mounts": ("import ctypes, os\ndef solve():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
                      "    if libc.unshare(0x10000000 | 0x00020000) != 0:\n        return 0\n"
                      "    os.makedirs('/tmp/big', exist_ok=True)\n"
                      "    ok = libc.mount(b'none', b'/tmp/big', b'tmpfs', 0, b'size=3g') == 0\n"
                      "    ok += libc.mount(b'none', b'/tmp/big', b'cgroup2', 0, None) == 0\n    return int(ok)",
                      ["assert solve() > 0"]),
    "kernel_interfaces": ("import ctypes\ndef solve():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
                          "    reached = libc.syscall(101, 0, 0, 0, 0) == 0\n"  # ptrace(PTRACE_TRACEME)
                          "    attr = ctypes.create_string_buffer(128)\n"
                          "    reached += libc.syscall(321, 0, attr, 128) >= 0\n"  # bpf(BPF_MAP_CREATE)
                          "    reached += libc.syscall(298, attr, 0, -1, -1, 0) >= 0\n"  # perf_event_open
                          "    return reached", ["assert solve() > 0"]),
    "memory_outside": ("import os\ndef solve():\n    n = 0\n    for _ in range(64):\n        try:\n"
                       "            fd = os.memfd_create('x')\n            for _ in range(16):\n"
                       "                os.write(fd, b'x' * (1 << 20)); n += 1\n        except OSError:\n"
                       "            break\n        if n > 160:\n            return n\n"
                       "    for d in ('/', '/etc', '/dev', '/usr'):\n        try:\n"
                       "            with open(d.rstrip('/') + '/rlkit-fill', 'wb') as f:\n"
                       "                while n <= 160:\n                    f.write(b'x' * (1 << 20)); n += 1\n"
                       "        except OSError:\n            pass\n    return n",
                       ["assert solve() > 128"]),  # MiB past /tmp's and /dev/shm's 64 each
    # memory held by several processes, each within its own bound (512 MiB): more than the sample's
    # 512 + 64 MiB in all, which only a memory cgroup bounds
    "memory_in_processes": ("import os\ndef solve():\n    r, w = os.pipe()\n    for _ in range(3):\n"
                            "        if os.fork() == 0:\n            x = bytearray(300 << 20)\n"
                            "            for i in range(0, len(x), 4096):\n                x[i] = 1\n"
                            "            os.write(w, b'1'); import time; time.sleep(5); os._exit(0)\n"
                            "    x = bytearray(300 << 20)\n    for i in range(0, len(x), 4096):\n        x[i] = 1\n"
                            "    got = 0\n    while got < 3:\n        got += len(os.read(r, 3 - got))\n"
                            "    return 300 * (got + 1)", ["assert solve() >= 1200"]),
    # leaving things behind, filling, flooding, bombs
    "leftovers": ("import ctypes, os\ndef solve():\n    for d in ('.', '/tmp', '/var/tmp', '/dev/shm'):\n        try:\n"
                  "            os.makedirs(d + '/rlkit-leftover/deep', exist_ok=True)\n"
                  "            open(d + '/rlkit-leftover/deep/f', 'w').write('x')\n"
                  "        except OSError:\n            pass\n"
                  "    try:\n        libc = ctypes.CDLL(None)\n        seg = libc.shmget(0x5eed, 1 << 20, 0o1666)\n"
                  "        libc.shmat(seg, None, 0)\n    except Exception:\n        pass\n"
                  "    if os.fork() == 0:\n        os.setsid(); import time; time.sleep(60)\n    return 0",
                  ["assert solve() == 1"]),
    # a POSIX message queue: kernel memory outside every process's bound that outlives the sample (10 x 8 KiB)
    "message_queue": ("import ctypes, os\ndef solve():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
                      "    attr = (ctypes.c_long * 8)(0, 10, 8192, 0)\n"
                      "    q = libc.mq_open(b'/rlkit-attack-mq', os.O_CREAT | os.O_WRONLY, 0o666, attr)\n"
                      "    return 0 if q < 0 else sum(libc.mq_send(q, b'x' * 8192, 8192, 0) == 0 for _ in range(10))",
                      ["assert solve() == 1"]),
    "disk_fill": ("def solve():\n    with open('fill', 'wb') as f:\n        for _ in range(4096):\n"
                  "            f.write(b'x' * (1 << 20))\n    return 0", ["assert solve() == 1"]),
    "output_flood": ("import os, sys\nfor fd in (*range(3, 16), 1, 2):\n    try:\n        for _ in range(4096):\n"
                     "            os.write(fd, b'x' * 65536)\n    except OSError:\n        pass\nprint('y' * 10**8)",
                     ["assert solve() == 1"]),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  ["assert solve() == 1"]),
    "memory_bomb": ("x = bytearray(8 * 1024 ** 3)\ny = [0] * (10 ** 9)", ["assert solve() == 1"]),
    "infinite_loop": ("while True:\n    pass", ["assert solve() == 1"]),
}


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _add_key(description: bytes, payload: bytes) -> int:
    """A user key in this process's session keyring (x86_64 add_key); -1 where keyrings are off."""
    return _libc().syscall(248, b"user", description, payload, len(payload), -3)


def _find_key(description: bytes) -> int:
    """The id of a user key reachable from the session keyring (KEYCTL_SEARCH), else -1."""
    return _libc().syscall(250, 10, -3, b"user", description, 0)


def _keys_left(*ours: int) -> list[str]:
    """A key the candidate planted in the driver's session keyring; ours and it are removed."""
    planted = _find_key(b"rlkit-planted")
    for key in (*ours, planted):
        if key > 0:
            _libc().syscall(250, 21, key)  # KEYCTL_INVALIDATE
    return ["planted a key in the driver's session keyring"] if planted > 0 else []


def _listing(shared: str) -> set[str]:
    """What the shared temporary folders hold: their entries, and everything in ``shared``."""
    seen = set()
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        with contextlib.suppress(OSError):
            seen.update(os.path.join(d, n) for n in os.listdir(d))
    for root, dirs, files in os.walk(shared):
        seen.update(os.path.join(root, n) for n in dirs + files)
    return seen


def _sysv_shm() -> set[str]:
    try:
        with open("/proc/sysvipc/shm") as f:
            return {line.split()[1] for line in f.readlines()[1:]}
    except OSError:
        return set()


def _message_queue_left() -> list[str]:
    """The attack's POSIX message queue where the driver can open it (then removed)."""
    libc = _libc()
    q = libc.mq_open(b"/rlkit-attack-mq", os.O_RDONLY)
    if q < 0:
        return []
    libc.mq_close(q)
    libc.mq_unlink(b"/rlkit-attack-mq")
    return ["left POSIX message queue /rlkit-attack-mq"]


def _sandbox_processes() -> list[str]:
    """Processes of a sandbox still alive (bubblewrap, or the judge's runner)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"cfg = json.loads(req.readline())" in cmd or cmd.split(b"\0")[0].endswith(b"bwrap"):
            left.append(pid)
    return left


def _lasting_processes() -> list[str]:
    """Sandbox processes still alive a moment after the run (the kernel ends a PID namespace's
    processes after its init, not with it)."""
    for _ in range(40):
        if not _sandbox_processes():
            break
        time.sleep(0.05)
    return _sandbox_processes()


def _clean(left: list[str], home: str, shared: str, *servers: socket.socket) -> None:
    """Remove what the candidate wrote or left (reported already: a weaker mode lets it) and the traps."""
    for p in left:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(p)
    del os.environ["RLKIT_ATTACK_SECRET"]
    for s in servers:
        s.close()
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(shared, ignore_errors=True)


def scenario(name: str, audit: bool, isolation: str = "namespaces") -> dict:
    """Set up the traps, run the candidate in the sandbox of ``isolation``, report its score and
    each way it got out."""
    from rewards.code import run_tests

    home = tempfile.mkdtemp(prefix="rlkit-attack-")
    shared = tempfile.mkdtemp(prefix="rlkit-attack-shared-")  # nested world-writable folder
    os.chmod(shared, 0o1777)
    secret_file = os.path.join(home, "token.txt")
    with open(secret_file, "w") as f:
        f.write(SECRET)
    os.environ["RLKIT_ATTACK_SECRET"] = SECRET
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.1)
    unix_path, abstract = os.path.join(home, "sock"), "rlkit-attack-" + uuid.uuid4().hex
    unix_servers = []
    for addr in (unix_path, "\0" + abstract):
        u = socket.socket(socket.AF_UNIX)
        u.bind(addr)
        u.listen(4)
        u.settimeout(0.1)
        unix_servers.append(u)
    victim = subprocess.Popen(["sleep", "60"])
    checkout_file = os.path.join(CHECKOUT, "rewards", "code.py")
    with open(checkout_file) as f:
        checkout_len = len(f.read())
    outside = [os.path.join(home, "escaped"), f"/tmp/rlkit-escape-{uuid.uuid4().hex}",
               f"/var/tmp/rlkit-escape-{uuid.uuid4().hex}", f"/dev/shm/rlkit-escape-{uuid.uuid4().hex}",
               os.path.join(shared, "escaped"), os.path.join(CHECKOUT, f"rlkit-escape-{uuid.uuid4().hex}")]
    secret_key = _add_key(b"rlkit-attack", SECRET.encode())
    before, shm_before = _listing(shared), _sysv_shm()
    code, tests = ATTACKS[name]
    fill = {"secret": SECRET, "secret_int": int(SECRET[7:], 16), "secret_file": secret_file,
            "checkout_file": checkout_file, "checkout_len": checkout_len, "outside": outside,
            "port": server.getsockname()[1],
            "host_only": [outside[0], outside[4], outside[5]], "unix_path": unix_path, "abstract": abstract,
            "victim": victim.pid, "driver": os.getpid()}
    t0 = time.perf_counter()
    verdict = run_tests(code.format(**fill), [t.format(**fill) for t in tests], timeout_s=1.0, audit=audit,
                        isolation=isolation)
    seconds = time.perf_counter() - t0
    escaped = []
    for s in (server, *unix_servers):
        try:
            s.accept()
            escaped.append(f"a connection reached {s.getsockname()!r}")
        except OSError:
            pass
    if victim.poll() is not None:
        escaped.append("the driver's other process was killed")
    victim.kill()
    victim.wait()
    escaped += [f"wrote {p}" for p in outside if os.path.exists(p)]
    new = sorted(_listing(shared) - before)
    escaped += [f"left {p}" for p in new]
    escaped += [f"left SysV shared memory {k}" for k in sorted(_sysv_shm() - shm_before)]
    escaped += _keys_left(secret_key)
    escaped += _message_queue_left()
    escaped += [f"left process {p}" for p in _lasting_processes()]
    if seconds > 8:
        escaped.append(f"took {seconds:.1f} s")
    _clean(outside + new, home, shared, server, *unix_servers)
    from rlkit.sandbox.cgroup import delegated

    return {"score": verdict.score, "timed_out": verdict.timed_out, "flooded": verdict.flooded,
            "seconds": seconds, "escaped": escaped, "cgroup": delegated() is not None}


if __name__ == "__main__":  # python -m tests.rewards.attacks AUDIT ISOLATION NAME...: one JSON report per line
    for name in sys.argv[3:]:
        sys.stdout.write(json.dumps({"attack": name, **scenario(name, sys.argv[1] == "1", sys.argv[2])}) + "\n")
