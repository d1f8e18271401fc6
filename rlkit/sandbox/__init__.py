"""Untrusted code walled off: a component of its own, needing nothing of rlkit but its errors.

`walls.py` starts a walled command (bubblewrap's namespaces with the binds, working folder and
environment a caller gives, or a plain process; the seccomp filter of `seccomp.py`, the throwaway
uids of `uids.py`, a memory cgroup of `cgroup.py`) and `pipes.reap` ends all of it: the code
judge's programs and the agent's commands both start there. The code judge is built on it:
`programs.py` (a Python program walled, or on a SandboxFusion service), `judge.py`, `runners.py`,
`wire.py`, `relay.py`, `probes.py`."""
