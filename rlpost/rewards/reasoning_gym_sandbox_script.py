"""Runs inside the sandbox: scores reasoning-gym answers, each in a fresh forked process.

Reads one JSON object on stdin: ``nonce``, ``paths`` (sys.path inside the sandbox),
``timeout_s`` (per answer) and ``items`` (base64 of a pickled list of
``(task, config, entry, answer)``, plain data from the trusted side). Imports
reasoning-gym once, makes every task's dataset, then scores each item in a child
forked for it and prints ``<nonce> <index> start`` before and
``<nonce> <index> <score>`` after. The answer a scorer evaluates runs in that child:
its stdin, stdout and stderr are /dev/null and it holds only the pipe its score goes
back through, so it cannot print a marker; this process is not dumpable, so the child
cannot trace it or open its file descriptors; /tmp is off ``sys.path``, so nothing the
child writes there is imported later; and every process but pid 1 and this one is
killed once the item is done, so nothing it starts outlives it. What the child can
still do is decide its own score, or kill this process, which ends the run: the
trusted side then scores the item in progress 0 and runs the rest again.

Standard library only up to the import of reasoning-gym.
"""

import base64
import ctypes
import json
import os
import pickle
import select
import signal
import sys
import time

_PR_SET_DUMPABLE = 4
_MAX_REPLY = 64


def _not_dumpable():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _child(dataset, answer, entry, w):
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, w)
        os.closerange(w + 1, 1 << 16)
        value = float(dataset.score_answer(answer, entry))
        os.write(w, repr(value).encode())
    finally:
        os._exit(0)


def _read_reply(r, deadline):
    reply = b""
    while len(reply) <= _MAX_REPLY:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            return None
        chunk = os.read(r, _MAX_REPLY)
        if not chunk:
            break
        reply += chunk
    try:
        return float(reply.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def _kill_the_rest():
    me = os.getpid()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            try:
                os.kill(int(name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def _score(dataset, answer, entry, timeout_s):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(dataset, answer, entry, w)
    os.close(w)
    try:
        return _read_reply(r, time.monotonic() + timeout_s)
    finally:
        os.close(r)
        _kill_the_rest()


def main():
    spec = json.loads(sys.stdin.read())
    sys.path[:] = spec["paths"]
    import reasoning_gym

    items = pickle.loads(base64.b64decode(spec["items"]))
    datasets = {}
    for task, config, _, _ in items:
        key = (task, json.dumps(config, sort_keys=True, default=str))
        if key not in datasets:
            datasets[key] = reasoning_gym.create_dataset(task, seed=0, size=1, **config)
    _not_dumpable()
    nonce = spec["nonce"]
    for i, (task, config, entry, answer) in enumerate(items):
        dataset = datasets[(task, json.dumps(config, sort_keys=True, default=str))]
        print(f"{nonce} {i} start", flush=True)
        value = _score(dataset, answer, entry, spec["timeout_s"])
        print(f"{nonce} {i} {'nan' if value is None else repr(value)}", flush=True)


if __name__ == "__main__":
    main()
