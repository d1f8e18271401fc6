"""The shell commands the README and the docs pages show, for the tests that run them.

A command is a line of a fenced `bash` block (a trailing backslash joins the next line; a comment
after two spaces and `#` is dropped). `rlkit ...` lines run as `python -m rlkit.cli ...`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_commands(page: Path) -> list[str]:
    """Every command of the page's bash blocks, in order."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s{2,}#", line)[0].strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    return found


def all_commands() -> dict[str, list[str]]:
    """Each command of every page, with the pages that show it."""
    where: dict[str, list[str]] = {}
    for page in PAGES:
        for command in shell_commands(page):
            where.setdefault(command, []).append(str(page.relative_to(ROOT)))
    return where


def command_on(page: str, start: str) -> str:
    """The command on `page` (relative to the checkout) that starts with `start`: exactly one."""
    hits = [c for c in shell_commands(ROOT / page) if c.startswith(start)]
    assert len(hits) == 1, f"{page}: {len(hits)} commands start with {start!r}: {hits}"
    return hits[0]


def run_rlkit(command: str, cwd: Path, timeout: int = 600, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run an `rlkit ...` line of the docs as written (plus `extra` arguments), in `cwd`."""
    argv = shlex.split(command)
    assert argv[0] == "rlkit", command
    return subprocess.run([sys.executable, "-m", "rlkit.cli", *argv[1:], *extra], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
