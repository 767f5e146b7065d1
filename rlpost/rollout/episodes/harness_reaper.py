"""Run a harness command and leave nothing it started behind (stdlib only: run by path).

    python -I -S harness_reaper.py PARENT_PID UID SCRATCH COMMAND [ARG...]

As a child subreaper (``PR_SET_CHILD_SUBREAPER``) every orphaned descendant, ``setsid``
daemons included, is reparented here; when the command exits, SIGTERM comes or the parent
dies, its children are killed and reaped round after round until none is left (only its own
unreaped children, so no pid was reused). ``UID`` (``-``: none) runs the command under that
uid and group. ``private`` for ``SCRATCH`` mounts fresh tmpfs on ``/tmp`` and ``/dev/shm`` in a
mount namespace of its own, binding a ``HOME`` under ``/tmp`` into it.

Exits with the command's status (128 + the signal that ended it; 127: it did not start).
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000


def _children() -> set[int]:
    """The pids of this process's children, zombies included."""
    me, pids = os.getpid(), set()
    try:
        for task in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        return pids
    except OSError:  # a kernel without /proc/PID/task/TID/children: scan every process
        pass
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            pids.add(int(name))
    return pids


def kill_all() -> None:
    """Kill and reap every child until there is none (ChildProcessError)."""
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)  # one at a time; the next round sees its orphans
        except ChildProcessError:
            return


def _on_signal(signum, frame) -> None:
    kill_all()
    os._exit(128 + signum)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def private_scratch(libc) -> None:
    """Fresh tmpfs on /tmp and /dev/shm, in a mount namespace of this process's own."""
    uid, gid, home = os.geteuid(), os.getegid(), os.environ.get("HOME", "")
    _check(libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if uid else 0)), "unshare")
    if uid:  # the user namespace maps only our own ids: the command keeps its user
        for name, line in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(line)
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    kept = os.open(home, os.O_PATH | os.O_DIRECTORY) if home.startswith("/tmp/") else None
    for path in ("/tmp", "/dev/shm"):
        if os.path.isdir(path):
            flags, options = MS_NOSUID | MS_NODEV, b"mode=1777"
            _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, options), f"tmpfs {path}")
    if kept is not None:
        os.makedirs(home)
        _check(
            libc.mount(f"/proc/self/fd/{kept}".encode(), home.encode(), None, MS_BIND, None),
            f"bind {home}",
        )
        os.close(kept)


def main(parent: int, uid: int | None, scratch: str, argv: list[str]) -> int:
    libc = None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the runner's process-group kill remains
        pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    if os.getppid() != parent:  # the runner died before the death signal was armed
        return 128 + signal.SIGTERM
    if scratch == "private":
        try:
            private_scratch(libc)
        except (OSError, AttributeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            print(f"cannot give the command a private /tmp ({why})", file=sys.stderr)
            return 127
    user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        child = subprocess.Popen(argv, **user)
    except OSError as exc:
        line = f"cannot run {argv[0]!r}: {exc.strerror}"
        if uid is not None:
            line = f"cannot run {argv[0]!r} as uid {uid}, the harness's own user: {exc.strerror}; "
            line += "make the command and what it reads readable by other users, or set "
            line += "agent.harness.user=trainer"
        if scratch == "private" and argv[0].startswith(("/tmp/", "/dev/shm/")):
            line += "; the command sees a /tmp and /dev/shm of its own: keep it elsewhere"
        print(line, file=sys.stderr)
        return 127
    code = child.wait()
    kill_all()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    uid = None if sys.argv[2] == "-" else int(sys.argv[2])
    sys.exit(main(int(sys.argv[1]), uid, sys.argv[3], sys.argv[4:]))
