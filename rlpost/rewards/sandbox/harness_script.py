"""Assert-test harness: runs inside the sandbox as main.py, standard library only.

stdin holds one JSON object ``{"nonce", "code", "tests", "timeout_s"}``. For
each test the harness starts a fresh interpreter that runs the candidate code
and then the test in one namespace; that child proves success only by writing
``pass`` to a private pipe after both ran without raising. The harness then
writes ``<nonce> <index> pass|fail|timeout`` on its own stdout.

Why this shape: the candidate never runs in the harness's process, so it
cannot monkeypatch the harness's output or read the nonce from its memory (the
harness makes itself non-dumpable, which closes its /proc/<pid>/mem and fd
entries to other processes of the same uid); the candidate's stdout and
stderr go to the harness's stderr, and a forged line without the nonce is
ignored by the host. ``sys.exit(0)`` or ``os._exit(0)`` before the test ran
leave the pipe empty and count as a failure, and the child holds its own
references to ``exec`` and ``os.write`` so patching builtins cannot skip the
test. Each test runs in its own session, killed after it, so a looping or
forking test costs only its own time budget.
"""

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys

_PR_SET_DUMPABLE = 4
_PASS = b"pass"

# Runs in the child, as -c code. Everything it needs after the candidate's code
# starts is bound to locals first: the candidate shares the interpreter.
_CHILD = r"""
import json, os, sys, traceback

def main():
    run, compile_, write, exit_now = exec, compile, os.write, os._exit
    report = int(sys.argv[1])
    spec = json.loads(sys.stdin.read())
    namespace = {"__name__": "solution"}
    try:
        run(compile_(spec["code"], "solution.py", "exec"), namespace)
        run(compile_(spec["test"], "test.py", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    write(report, b"pass")
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
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-E", "-s", "-S", "-c", _CHILD, str(write_fd)]
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
        child.communicate(json.dumps({"code": code, "test": test}).encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # whatever the test left running
    child.wait()
    os.set_blocking(read_fd, False)
    try:
        report = os.read(read_fd, len(_PASS) + 1)
    except BlockingIOError:  # a leftover still holds the pipe open, empty
        report = b""
    os.close(read_fd)
    if timed_out:
        return "timeout"
    return "pass" if report == _PASS and child.returncode == 0 else "fail"


if __name__ == "__main__":
    main()
