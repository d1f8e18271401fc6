"""Throwaway uids for sandboxed runs as root, each held by one run at a time on the whole host.

A run as root drops to a uid no account has (1,000,000,000 up). Two drivers on one host (two
runs, or one run's reward actors) draw from the same range, so a uid is claimed before it is
used: an exclusive `flock` on a file named after it in a folder only root may enter, held until
the run is reaped and the uid's leftovers swept (`release`). The kernel drops the lock of a
driver that dies, so nothing stays claimed after its process; a released uid's file is removed
under its lock, and a claim that finds its file gone or replaced tries the next uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import stat
import threading
from collections.abc import Callable

from rlkit.errors import RewardError

BASE = 1_000_000_000
SPAN = 1_000_000  # uids BASE .. BASE + SPAN - 1
FOLDER = "/run/rlkit-uids"  # root's: /run is writable by root only
_lock = threading.Lock()
_held: dict[int, int] = {}  # uid -> the descriptor holding its claim
_next = random.SystemRandom().randrange(SPAN)  # where this process starts looking


def _folder() -> str:
    """The claims' folder: made by root, mode 0700; one a user made first (or a link) is refused."""
    try:
        os.mkdir(FOLDER, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RewardError(f"the code sandbox's uid claims need {FOLDER} ({e.strerror}): run as root "
                          "with /run writable, or not as root") from None
    st = os.lstat(FOLDER)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise RewardError(f"{FOLDER} is not a folder only root may enter: remove it (the code sandbox "
                          "claims its throwaway uids there)")
    return FOLDER


def claim(sweep: Callable[[int], None] | None = None) -> int:
    """A throwaway uid no other run on this host holds, claimed until `release(uid)`. One whose file a
    driver that died left (claimed, never released) is given to `sweep` first: what ran as it may
    still run."""
    global _next
    with _lock:
        folder = _folder()
        for _ in range(SPAN):
            uid, _next = BASE + _next, (_next + 1) % SPAN
            if uid in _held:
                continue
            path = os.path.join(folder, str(uid))
            left = os.path.lexists(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except OSError:  # held by another run, or its file removed by a release meanwhile
                same = False
            if same:
                _held[uid] = fd
                if left and sweep is not None:
                    sweep(uid)
                return uid
            os.close(fd)
    raise RewardError(f"every throwaway uid from {BASE} to {BASE + SPAN - 1} is held by a run on this host")


def release(uid: int | None) -> None:
    """Give back a claimed uid (after its run's processes and leftovers are gone); None: nothing."""
    with _lock:
        fd = _held.pop(uid, None) if uid is not None else None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(FOLDER, str(uid)))  # under the lock: a claim waiting on it retries
        os.close(fd)


def held() -> set[int]:
    """The uids this process holds now."""
    with _lock:
        return set(_held)
