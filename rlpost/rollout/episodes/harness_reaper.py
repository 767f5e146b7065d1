"""Run a harness command and leave nothing it started behind (stdlib only: run by path).

    python -I -S harness_reaper.py PARENT_PID UID COMMAND [ARG...]

This process marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every
descendant of the command whose parent exits is reparented here rather than to init:
background jobs, double forks and ``setsid`` daemons included (a new session or process
group does not leave the subreaper's tree). When the command exits, or this process
gets SIGTERM (the runner's timeout) or its parent dies (``PR_SET_PDEATHSIG``), every
child of this process is killed and reaped, round after round, until none is left: an
orphan of a killed one is reparented here and killed on the next round. Only its own,
unreaped children are signalled, so no pid can have been reused by a stranger.
With a number for ``UID`` (``-``: none) the command runs under that uid, its group
the same number and no other group; this process keeps its own user, so it can
still kill whatever the command started.

Exits with the command's status (128 + the signal that ended it; 127: it did not start).
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


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


def main(parent: int, uid: int | None, argv: list[str]) -> int:
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
    user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        child = subprocess.Popen(argv, **user)
    except OSError as exc:
        line = f"cannot run {argv[0]!r}: {exc.strerror}"
        if uid is not None:
            line = f"cannot run {argv[0]!r} as uid {uid}, the harness's own user: {exc.strerror}; "
            line += "make the command and what it reads readable by other users, or set "
            line += "agent.harness.user=trainer"
        print(line, file=sys.stderr)
        return 127
    code = child.wait()
    kill_all()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), None if sys.argv[2] == "-" else int(sys.argv[2]), sys.argv[3:]))
