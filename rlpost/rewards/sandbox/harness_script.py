"""Assert-test harness: runs inside the sandbox as main.py, standard library only.

stdin holds one JSON object ``{"nonce", "code", "tests", "timeout_s"}``. For
each test the harness starts a fresh interpreter that runs the candidate code
and then the test in one namespace; that child proves success only by writing
``pass`` to a private pipe after both ran without raising. The harness then
writes ``<nonce> <index> pass|fail|timeout`` on its own stdout.

The candidate never runs in the (non-dumpable) harness, so it cannot forge the harness's
output or read the nonce; an early exit leaves the pipe empty, a failure. Each test runs in
its own session, killed after it. In the child, the report is a fresh random token per test
whose value and pipe descriptor arrive on stdin, and an audit hook refuses listing
descriptors and walking the object graph or other frames. ``sys._getframe`` stays open (the
standard library needs it to import), so the token hinders a cheat, not proves against one.
"""

import contextlib
import ctypes
import json
import os
import resource
import secrets
import signal
import subprocess
import sys

_PR_SET_DUMPABLE = 4

# Runs in the child, as -c code; what it needs after the candidate starts is bound first.
_CHILD = r"""
import json, os, sys

def _guard():
    closed = ("/proc/self/fd", "/proc/thread-self/fd", "/dev/fd", f"/proc/{os.getpid()}/fd")
    frames = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"}
    introspect = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"}

    def hook(event, args):
        if event in introspect:
            raise RuntimeError(f"{event} is not allowed in a test")
        if event == "object.__getattr__" and len(args) > 1 and args[1] in frames:
            raise RuntimeError(f"{args[1]} is not allowed in a test")
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str):
            if args[0].rstrip("/").startswith(closed):
                raise RuntimeError(f"{args[0]} is not allowed in a test")

    sys.addaudithook(hook)

def main():
    run, compile_, write, exit_now = exec, compile, os.write, os._exit
    report_error, exc_info = sys.__excepthook__, sys.exc_info  # C: reads no frame attributes
    spec = json.loads(sys.stdin.read())
    code, test, fd, token = spec["code"], spec["test"], spec["fd"], spec["token"].encode()
    del spec
    namespace = {"__name__": "solution"}
    _guard()
    try:
        run(compile_(code, "solution.py", "exec"), namespace)
        run(compile_(test, "test.py", "exec"), namespace)
    except BaseException:
        report_error(*exc_info())
        exit_now(1)
    write(fd, token)
    exit_now(0)

main()
"""


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    _make_undumpable()
    nonce = spec["nonce"]
    for index, test in enumerate(spec["tests"]):
        outcome = _run_test(spec["code"], test, float(spec["timeout_s"]))
        # os.write, unbuffered: a marker is out even if the run is killed later.
        os.write(1, f"{nonce} {index} {outcome}\n".encode())


def _make_undumpable() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _run_test(code: str, test: str, timeout_s: float) -> str:
    token = os.urandom(16).hex()  # what a passing test writes: new for every test
    read_fd, pipe_fd = os.pipe()
    write_fd = _random_fd(pipe_fd)
    argv = [sys.executable, "-E", "-s", "-S", "-c", _CHILD]
    spec = {"code": code, "test": test, "fd": write_fd, "token": token}
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=2,
            stderr=2,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    except OSError as exc:  # e.g. the process cap is held by a previous test's leftovers
        os.write(2, f"harness: cannot start test: {exc}\n".encode())
        os.close(read_fd)
        return "fail"
    finally:
        os.close(write_fd)
    timed_out = False
    try:
        child.communicate(json.dumps(spec).encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # whatever the test left running
    child.wait()
    os.set_blocking(read_fd, False)
    try:
        report = os.read(read_fd, len(token) + 1)
    except BlockingIOError:  # a leftover still holds the pipe open, empty
        report = b""
    os.close(read_fd)
    if timed_out:
        return "timeout"
    return "pass" if report == token.encode() and child.returncode == 0 else "fail"


def _random_fd(fd: int) -> int:
    """``fd`` moved to a free descriptor number drawn at random (closed at the old one)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    high = min(soft if soft > 0 else 1024, 4096)
    for _ in range(64):
        want = 64 + secrets.randbelow(max(1, high - 64))
        try:
            os.fstat(want)
        except OSError:  # free
            os.dup2(fd, want)
            os.close(fd)
            return want
    return fd


if __name__ == "__main__":
    main()
