"""A uid of its own for each harness command, so no harness can read another's key.

A same-user process can read ``/proc/PID/environ``, where a session's key is. As root, each
command runs under a uid from :data:`HARNESS_UIDS`, held by an ``flock`` for its life, with a
fresh private ``HOME``; otherwise as the trainer's user (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import random
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

HARNESS_UIDS = range(50000, 60000)  # reserved for harness commands; each used by one at a time
LOCK_DIRS = (Path("/run/rlpost-harness-uids"), Path(tempfile.gettempdir()) / "rlpost-harness-uids")


@dataclass
class HarnessUser:
    """A uid held for one command: its number, its private home, the lock that holds it."""

    uid: int
    home: Path
    lock: int  # the open, flocked file descriptor

    def release(self) -> None:
        """Remove the home and free the uid (after the command and all it started ended)."""
        shutil.rmtree(self.home, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self.lock)


def isolates() -> bool:
    """Whether commands get a uid of their own here: only root can change uid."""
    return os.geteuid() == 0


def reserve() -> HarnessUser:
    """A free uid of :data:`HARNESS_UIDS`, held until ``release``; RuntimeError when none is."""
    locks = _lock_dir()
    start = random.randrange(len(HARNESS_UIDS))  # concurrent trainers rarely probe the same
    for i in range(len(HARNESS_UIDS)):
        uid = HARNESS_UIDS[(start + i) % len(HARNESS_UIDS)]
        if _has_account(uid):
            continue
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        home = Path(tempfile.mkdtemp(prefix=f"rlpost-harness-{uid}-"))
        os.chown(home, uid, uid)
        return HarnessUser(uid, home, fd)
    raise RuntimeError(
        f"every harness uid in {HARNESS_UIDS.start}-{HARNESS_UIDS.stop - 1} is in use; "
        "lower agent.harness.workers"
    )


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _lock_dir() -> Path:
    """The first of :data:`LOCK_DIRS` that is, or can be made, a directory only root owns."""
    for path in LOCK_DIRS:
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o077:
                return path
    raise RuntimeError(
        f"no root-only directory for harness uid locks ({', '.join(map(str, LOCK_DIRS))})"
    )
