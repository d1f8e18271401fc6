"""`rollout.program`: the user's own agent program, trained through rlkit's OpenAI-compatible
endpoint (rlkit/agent/endpoint.py, rlkit/agent/program.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlkit.recipe import check


@dataclass(frozen=True)
class ProgramConfig:
    # "module:function" or "file.py:function" beside the recipe: run(row, client) -> None, a reward,
    # or {"reward": r, ...}; `client` is an openai.OpenAI whose base URL is this rollout's session
    fn: str | None = None
    # or a command run once per rollout (rlkit/agent/command.py): its session in OPENAI_BASE_URL and
    # OPENAI_API_KEY, the row in RLKIT_ROW and on stdin, the last line of its stdout its reward
    command: str | tuple[str, ...] | None = None
    # a command's walls: namespaces = the code sandbox's, with the endpoint its only way out;
    # process = a child process with the driver's network and files
    isolation: Literal["namespaces", "process"] = "namespaces"
    memory_mb: int = 4096  # a command's address space (each process)
    max_procs: int = 64  # a command's processes and threads (as root)
    timeout_s: float = 120.0  # a rollout's program running longer is cut off: its rollout fails
    concurrency: int = 64  # programs running at once (threads of the driver)
    host: str = "127.0.0.1"  # the endpoint's address (loopback: only programs on this machine)
    port: int = 0  # 0 = a free port
    # a request's own temperature, top_p, max_tokens, stop, seed...: override = logged and the
    # recipe's used; refuse = the request fails (HTTP 400) and costs its rollout
    sampling: Literal["override", "refuse"] = "override"
    max_requests: int = 64  # requests one rollout may send; past it they are refused (a flood)
    batch_wait_s: float = 0.02  # how long a request waits for others to share an engine call

    @property
    def on(self) -> bool:
        """Whether the run has an agent program."""
        return bool(self.fn or self.command)

    def __post_init__(self):
        check(not (self.fn and self.command), "command", "a program is a function (fn) or a command, not both")
        check(self.memory_mb >= 64, "memory_mb", f"must be >= 64 MiB, got {self.memory_mb}")
        check(self.max_procs >= 2, "max_procs", f"must be >= 2 (the program and the endpoint's relay), got "
              f"{self.max_procs}")
        check(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        check(self.concurrency >= 1, "concurrency", f"must be >= 1, got {self.concurrency}")
        check(0 <= self.port < 65536, "port", f"must be a TCP port (0 = a free one), got {self.port}")
        check(self.max_requests >= 1, "max_requests", f"must be >= 1, got {self.max_requests}")
        check(self.batch_wait_s >= 0, "batch_wait_s", f"must be >= 0 seconds, got {self.batch_wait_s}")
