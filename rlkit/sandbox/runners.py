"""The two programs a code reward runs per sample, each in its own sandbox (`rlkit.sandbox.programs`).

* ``CANDIDATE`` runs the model's code and nothing else. Given ``{input, output}`` tests, it runs the
  code as ``__main__`` on each input and sends its stdout back ("stdio"). Given assert tests it
  serves requests ("serve": call this name or object with these arguments, an attribute, an item,
  a length, the next item of an iterator) and sends back only what its code computed: plain data
  (`PLAIN`), or a reference to an object that stays on its side. "replay" is the same for a service
  that cannot converse (a remote one): each test's requests so far, answered in a fresh module.
* ``TESTS`` runs the test cases and never the model's code. The names a test uses freely that are
  neither builtins nor standard-library modules are the candidate's: calling one (or using a
  reference it sent) is a request to the other sandbox. Every expected value, comparison, builtin
  and helper of the test is computed here, on plain data rebuilt by exact type; a candidate's
  object cannot be compared, hashed or tested for truth (the test fails). It sends one verdict per
  test.

The driver (`rlkit.sandbox.relay`) starts both and carries the lines between them; it never decodes
what the candidate sends.
"""

from __future__ import annotations

from rlkit.sandbox.wire import PREAMBLE

CANDIDATE = PREAMBLE + r"""
if cfg["audit"]:
    sys.addaudithook(hook)
try:
    compiled = compile(cfg["code"], "solution.py", "exec")
except BaseException:
    compiled = None
MUTABLE = (list, dict, set, bytearray)
class Callback:
    def __init__(self, i):
        self.i = i
    def __call__(self, *args, **kwargs):
        if cfg["mode"] != "serve":
            raise RuntimeError("no callbacks here")
        send({"back": self.i, "args": enc(list(args), no_ref), "kwargs": enc(kwargs, no_ref)})
        while True:
            msg = json.loads(req.readline() or "null")
            if type(msg) is dict and "r" in msg:
                return dec(msg["r"], no_peer)
            if type(msg) is dict and "rerr" in msg:
                raise RuntimeError("the test's function raised " + str(msg["rerr"]))
            if msg is None:
                raise EOFError
def no_ref(v):
    raise TypeError("not plain data: " + type(v).__name__)
def no_peer(tag, x):
    raise ValueError("not plain data")
class Module:
    def __init__(self):
        self.g = {"__name__": "solution"}
        self.objects = []
        self.ok = False
        if compiled is not None:
            try:
                exec(compiled, self.g)
                self.ok = True
            except BaseException:
                pass
    def keep(self, v):
        self.objects.append(v)
        return {"ref": len(self.objects) - 1}
    def peer(self, tag, x):
        if tag == "ref" and type(x) is int and 0 <= x < len(self.objects):
            return self.objects[x]
        if tag == "cb" and type(x) is int:
            return Callback(x)
        raise ValueError("not plain data")
    def target(self, ref):
        if type(ref) is str:
            if ref not in self.g or ref.startswith("__"):
                raise NameError(ref)
            return self.g[ref]
        return self.peer("ref", ref)
    def stdlib(self, name):
        v = self.g.get(name)
        mod = getattr(v, "__name__", None) if type(v) is type(sys) else getattr(v, "__module__", None)
        if type(mod) is not str or mod.split(".")[0] not in sys.stdlib_module_names:
            return None
        if type(v) is type(sys):
            return ["module", mod]
        qual = getattr(v, "__qualname__", None)
        if type(qual) is str and qual.isidentifier() and getattr(sys.modules.get(mod), qual, None) is v:
            return ["from", mod, qual]
        return None
    def answer(self, r):
        try:
            if not self.ok:
                raise RuntimeError("the code did not run")
            if r["op"] == "names":  # which of these are the standard library's own (its imports)
                return {"v": [self.stdlib(n) if type(n) is str else None for n in r["names"]]}
            op, obj = r["op"], self.target(r["ref"])
            if op == "call":
                args, kwargs = dec(r["args"], self.peer), dec(r["kwargs"], self.peer)
                out = {"v": enc(obj(*args, **kwargs), self.keep)}
                after = [enc(a, no_ref) if type(a) in MUTABLE else None for a in args]
                after = [a if a is not None and a != was else None for a, was in zip(after, r["args"])]
                if any(a is not None for a in after):  # an argument changed in place
                    out["after"] = after
                return out
            if op == "attr" and type(r["name"]) is str and not r["name"].startswith("__"):
                return {"v": enc(getattr(obj, r["name"]), self.keep)}
            if op == "item":
                return {"v": enc(obj[dec(r["key"], self.peer)], self.keep)}
            if op == "len":
                return {"v": enc(len(obj), self.keep)}
            if op == "iter":
                return {"v": self.keep(iter(obj))}
            if op == "next":
                try:
                    return {"v": enc(next(obj), self.keep)}
                except StopIteration:
                    return {"stop": True}
            raise TypeError("unknown request")
        except BaseException as e:
            return {"error": error_name(e)}
if cfg["mode"] == "stdio":
    for i, given in enumerate(cfg["inputs"]):
        buf = io.StringIO()
        sys.stdin, sys.stdout = io.StringIO(given), buf
        try:
            if compiled is None:
                raise SyntaxError
            try:
                exec(compiled, {"__name__": "__main__"})
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
            send({"i": i, "out": buf.getvalue()})
        except BaseException as e:
            send({"i": i, "error": error_name(e)})
elif cfg["mode"] == "serve":
    module = Module()
    for line in req:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if type(r) is dict and "op" in r:
            send(module.answer(r))
else:  # replay: each test's requests so far, in a module of its own
    for i, asked in cfg["tests"].items():
        module = Module()
        send({"t": i, "replies": [module.answer(r) for r in asked]})
"""

# What a test asks of plain data it expects: the methods of plain data that relate it to their
# argument (plain data always comes back as data, and its methods run on the tests' side). Asked of an
# object of the candidate's own, such a call would carry the expected value to it and let it answer,
# so it is not asked: the test fails. The other methods of plain data reshape it by their arguments
# (a width, a separator, a key); tests/sandbox/test_queries.py holds every method of the plain types
# to one side or the other.
QUERIES = frozenset({
    "startswith", "endswith", "find", "rfind", "index", "rindex", "count", "removeprefix", "removesuffix",
    "issubset", "issuperset", "isdisjoint", "difference", "intersection", "symmetric_difference",
    "compare", "compare_signal", "compare_total", "compare_total_mag", "same_quantum", "isclose", "is_integer"})

TESTS = PREAMBLE + "QUERIES_LIST = " + repr(sorted(QUERIES)) + "\n" + r"""
if cfg.get("undumpable"):  # "process" mode: no process of the same uid may read or write this one
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
if cfg["audit"]:
    sys.addaudithook(hook)
replay = cfg.get("replay")
known = {}
if replay is not None:  # the candidate's replies so far: the rest of stdin, as it sent them
    for line in req:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(rec) is dict and type(rec.get("t")) is str and type(rec.get("replies")) is list:
            known.setdefault(rec["t"], rec["replies"])
# the modules whose names a candidate's imports may bind on this side: data and arithmetic only
PURE = {"collections", "math", "cmath", "itertools", "functools", "operator", "fractions", "decimal", "heapq",
        "bisect", "string", "re", "statistics", "datetime", "typing", "copy", "array", "numbers", "enum",
        "dataclasses", "random", "json", "textwrap", "unicodedata", "struct", "binascii", "base64", "calendar",
        "zlib", "hashlib", "difflib", "graphlib", "ipaddress", "keyword", "pprint", "fnmatch"}
QUERIES = set(QUERIES_LIST)
class Pending(BaseException):  # a reply this round does not have yet (replay)
    pass
callbacks = []
def keep(v):
    if type(v) is Remote:
        return {"ref": v._ref}
    if callable(v) and replay is None:
        callbacks.append(v)
        return {"cb": len(callbacks) - 1}
    raise TypeError("cannot send a " + type(v).__name__ + " to the candidate")
def peer(tag, x):
    if tag == "ref" and type(x) is int:
        return Remote(x)
    raise ValueError("not plain data")
def plain_only(tag, x):
    raise ValueError("not plain data")
class Test:
    index, asked = "", []
def raised(name):
    cls = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls("raised by the candidate's code")
    return RuntimeError("the candidate's code raised " + str(name)[:64])
def ask(r):
    if replay is not None:
        replies = known.get(Test.index, [])
        Test.asked.append(r)
        if len(Test.asked) > len(replies):
            raise Pending
        reply = replies[len(Test.asked) - 1]
    else:
        send(r)
        while True:
            reply = json.loads(req.readline() or "null")
            if type(reply) is dict and "back" in reply:
                try:
                    f = callbacks[reply["back"]]
                    out = f(*dec(reply["args"], plain_only), **dec(reply["kwargs"], plain_only))
                    send({"r": enc(out, no_send)})
                except BaseException as e:
                    send({"rerr": error_name(e)})
                continue
            break
    if type(reply) is not dict:
        raise RuntimeError("no answer from the candidate")
    if "error" in reply:
        raise raised(reply["error"])
    if reply.get("stop") is True and r["op"] == "next":
        raise StopIteration
    return reply
def no_send(v):
    raise TypeError("not plain data")
def value(r):
    return dec(ask(r).get("v", {"missing": 0}), peer)
class Remote:
    __slots__ = ("_ref",)
    def __init__(self, ref):
        object.__setattr__(self, "_ref", ref)
    def __call__(self, *args, **kwargs):
        reply = ask({"op": "call", "ref": self._ref, "args": enc(list(args), keep), "kwargs": enc(kwargs, keep)})
        after = reply.get("after")
        if type(after) is list and len(after) == len(args):
            for a, new in zip(args, after):
                if new is not None and type(a) in (list, dict, set, bytearray):
                    new = dec(new, plain_only)
                    if type(new) is type(a):
                        if type(a) in (list, bytearray):
                            a[:] = new
                        else:
                            a.clear(); a.update(new)
        return dec(reply.get("v", {"missing": 0}), peer)
    def __getattr__(self, name):
        if name.startswith("__") or name in QUERIES:
            raise AttributeError(name)
        return value({"op": "attr", "ref": self._ref, "name": name})
    def __getitem__(self, key):
        return value({"op": "item", "ref": self._ref, "key": enc(key, keep)})
    def __len__(self):
        n = value({"op": "len", "ref": self._ref})
        if type(n) is not int:
            raise TypeError("len")
        return n
    def __iter__(self):
        return value({"op": "iter", "ref": self._ref})
    def __next__(self):
        return value({"op": "next", "ref": self._ref})
    def refused(self, *args):
        raise TypeError("a candidate's object cannot be compared, hashed or tested for truth here")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __contains__ = refused
    __setattr__ = __delattr__ = __setitem__ = __delitem__ = refused
def scope(names):
    g = {"__name__": "__test__", "__builtins__": builtins}
    theirs, modules, helpers = names
    for m in modules:
        try:
            g[m] = __import__(m)
        except ImportError:
            theirs.append(m)
    g.update({n: Remote(n) for n in theirs})
    g.update({n: math.isclose for n in helpers})  # a comparison helper: the test's own
    theirs = [n for n, v in g.items() if type(v) is Remote]
    if theirs:  # what the candidate imported from the standard library: this side's own copy
        for n, hint in zip(theirs, value({"op": "names", "names": theirs})):
            if type(hint) is list and len(hint) in (2, 3) and all(type(h) is str for h in hint) \
                    and hint[1].split(".")[0] in PURE:
                try:
                    import importlib
                    mod = importlib.import_module(hint[1])
                    g[n] = mod if hint[0] == "module" else getattr(mod, hint[2])
                except (ImportError, AttributeError, IndexError):
                    pass
    return g
for i, (src, names) in enumerate(zip(cfg["tests"], cfg["scopes"])):
    if cfg.get("only") is not None and i not in cfg["only"]:
        continue
    Test.index, Test.asked = str(i), []
    try:
        exec(compile(src, "test", "exec"), scope(names))
        send({"i": i, "ok": True})
    except Pending:
        send({"i": i, "pending": Test.asked})
    except BaseException:
        send({"i": i, "ok": False})
send({"done": True})
"""
