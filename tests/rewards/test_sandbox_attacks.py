"""Every adversarial candidate of `tests/rewards/attacks.py` is contained by the code reward's sandbox,
as root and as an ordinary user, with and without the in-process audit hook (the kernel's walls hold
on their own): it scores 0, reaches nothing of the driver's and leaves nothing behind. The weaker
`isolation: process` contains all but what `PROCESS_OPEN` names (docs/rewards.md's table says the
same), and those it must not contain either: the table is what the kernel shows."""

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rlkit.sandbox.walls import namespaces_problem
from tests.rewards.attacks import ATTACKS, CHECKOUT, scenario

# alone: a scenario lists the shared temporary folders before and after its run, and removes what is new
pytestmark = [pytest.mark.alone,
              pytest.mark.skipif(namespaces_problem() is not None, reason=f"no sandbox here: {namespaces_problem()}")]
USER = "rlkit-sandbox-test"
SYSTEM_PYTHON = "/usr/bin/python3"


def ordinary_user() -> int:
    """The uid of an ordinary user made for these tests (as root: created when missing; without
    `useradd`, a uid no account has, which the kernel treats the same)."""
    try:
        return pwd.getpwnam(USER).pw_uid
    except KeyError:
        pass
    if shutil.which("useradd"):
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                       check=True, capture_output=True)
        return pwd.getpwnam(USER).pw_uid
    return 64_999


# What "process" mode (no namespaces; the kernel's walls alone) leaves open, as root (a throwaway
# uid) and as an ordinary user (the driver's own uid): files every user can read, folders every user
# can write, and as the driver's uid its files, its processes' environment, what it leaves there.
PROCESS_OPEN = {"root": {"read_checkout", "write_outside"},
                "user": {"file_secret", "proc_environ", "read_checkout", "write_outside", "leftovers"}}


def check(report: dict, attack: str, isolation: str = "namespaces", user: str = "root") -> None:
    if attack == "memory_in_processes" and not report["cgroup"]:  # no memory cgroup delegated: the bound is
        assert report["escaped"] == [], report  # per process, as doctor says (its score is not the test's)
        return
    if isolation == "process" and attack in PROCESS_OPEN[user]:
        assert report["escaped"] or report["score"] > 0, report  # the table must not claim more than holds
        return
    assert report["escaped"] == [], report
    assert report["score"] == 0.0, report
    if attack == "infinite_loop":
        assert report["timed_out"]
    if attack == "output_flood":
        assert report["flooded"] or report["timed_out"]


@pytest.mark.parametrize("isolation, audit", [("namespaces", False), ("namespaces", True), ("process", False)],
                         ids=["kernel_only", "with_audit_hook", "process_kernel_only"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_contained_as_the_driver_user(attack, isolation, audit):
    """As the user the suite runs as (root in CI: the sandbox drops to a throwaway uid)."""
    check(scenario(attack, audit, isolation), attack, isolation, "root" if os.geteuid() == 0 else "user")


def readable_checkout(tmp: Path) -> Path:
    """The code the scenarios need (rlkit, the shipped rewards, this scenario module, and pyseccomp,
    which the sandbox's filter is built with: one module over the system's libseccomp), copied where
    an ordinary user can read it: the checkout itself may sit under a folder only root enters."""
    import pyseccomp

    copy = tmp / "checkout"
    for part in ("rlkit", "rewards"):
        shutil.copytree(Path(CHECKOUT) / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(pyseccomp.__file__, copy / "pyseccomp.py")
    (copy / "tests" / "rewards").mkdir(parents=True)
    for f in ("tests/__init__.py", "tests/rewards/__init__.py", "tests/rewards/attacks.py"):
        shutil.copy(Path(CHECKOUT) / f, copy / f)
    for path in (tmp, copy, *copy.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


@pytest.fixture(scope="module")
def ordinary_user_reports() -> dict[tuple[str, str], dict]:
    """Every attack's report, in each local isolation, from runs of the scenarios as an ordinary user
    (with the system's Python)."""
    if os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or not shutil.which("setpriv"):
        pytest.skip("needs root (to become an ordinary user), /usr/bin/python3 and setpriv")
    uid = ordinary_user()
    tmp = Path(tempfile.mkdtemp(prefix="rlkit-attacks-"))  # not under pytest's root-only folders
    try:
        code = str(readable_checkout(tmp))
        reports = {}
        for isolation in ("namespaces", "process"):
            out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                                  SYSTEM_PYTHON, "-m", "tests.rewards.attacks", "0", isolation, *ATTACKS],
                                 cwd=code, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": code, "HOME": "/tmp"},
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    reports[r.pop("attack"), isolation] = r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return reports


@pytest.mark.parametrize("isolation", ["namespaces", "process"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_contained_as_an_ordinary_user(attack, isolation, ordinary_user_reports):
    """The same scenarios run by an ordinary user the test creates (bubblewrap then adds a user
    namespace), with the kernel's walls alone (the audit hook on top is the driver-user test's case)."""
    check(ordinary_user_reports[attack, isolation], attack, isolation, "user")


# the rows of docs/rewards.md's guarantees table that each attack tests
ROW = {"file_secret": "the driver's files", "proc_environ": "the driver's environment", "env_secret":
       "the driver's environment", "read_checkout": "the checkout", "write_outside": "writing",
       "leftovers": "writing", "tcp_loopback": "network", "unix_sockets": "network",
       "signals": "the driver's processes", "parent_memory": "the driver's memory and pipes (`/proc/PID/mem`, "
       "`/proc/PID/fd`)", "parent_pipes": "the driver's memory and pipes (`/proc/PID/mem`, `/proc/PID/fd`)"}


def test_the_docs_table_says_what_the_tests_show():
    """A cell of the guarantees table is "open" exactly where an attack of its row gets through."""
    lines = (Path(CHECKOUT) / "docs" / "rewards.md").read_text(encoding="utf-8").splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("| | `namespaces`"))
    table = {}
    for line in lines[head + 2:]:
        if not line.strip().startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table[cells[0]] = dict(zip(["namespaces", "root", "user"], cells[1:4]))
    for row, cols in table.items():
        for col, cell in cols.items():
            opened = col != "namespaces" and any(ROW.get(a) == row for a in PROCESS_OPEN[col])
            assert cell.startswith("open") == opened, (row, col, cell)
    assert {ROW[a] for a in PROCESS_OPEN["root"] | PROCESS_OPEN["user"]} <= set(table)
