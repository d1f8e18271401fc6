"""Every adversarial candidate of `tests/rewards/attacks.py` is contained by the code reward's sandbox,
as root and as an ordinary user, with and without the in-process audit hook (the kernel's walls hold
on their own): it scores 0, reaches nothing of the driver's and leaves nothing behind."""

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rlkit.reward.sandbox import namespaces_problem
from tests.rewards.attacks import ATTACKS, CHECKOUT, scenario

pytestmark = pytest.mark.skipif(namespaces_problem() is not None, reason=f"no sandbox here: {namespaces_problem()}")
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


def check(report: dict, attack: str) -> None:
    assert report["escaped"] == [], report
    assert report["score"] == 0.0, report
    if attack == "infinite_loop":
        assert report["timed_out"]
    if attack == "output_flood":
        assert report["flooded"] or report["timed_out"]


@pytest.mark.parametrize("audit", [False, True], ids=["kernel_only", "with_audit_hook"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_contained_as_the_driver_user(attack, audit):
    """As the user the suite runs as (root in CI: the sandbox drops to a throwaway uid)."""
    check(scenario(attack, audit), attack)


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
def ordinary_user_reports() -> dict[str, dict]:
    """Every attack's report from one run of the scenarios as an ordinary user (with the system's Python)."""
    if os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or not shutil.which("setpriv"):
        pytest.skip("needs root (to become an ordinary user), /usr/bin/python3 and setpriv")
    uid = ordinary_user()
    tmp = Path(tempfile.mkdtemp(prefix="rlkit-attacks-"))  # not under pytest's root-only folders
    try:
        code = str(readable_checkout(tmp))
        out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                              SYSTEM_PYTHON, "-m", "tests.rewards.attacks", "0", *ATTACKS],
                             cwd=code, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": code, "HOME": "/tmp"},
                             capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    reports = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r.pop("attack"): r for r in reports}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_contained_as_an_ordinary_user(attack, ordinary_user_reports):
    """The same scenarios run by an ordinary user the test creates (bubblewrap then adds a user
    namespace), with the kernel's walls alone (the audit hook on top is the driver-user test's case)."""
    check(ordinary_user_reports[attack], attack)
