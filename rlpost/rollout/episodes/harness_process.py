"""A harness command as a process that gets what it needs and leaves nothing behind.

**Environment.** An allow-list, never the trainer's environment (which holds its
admin key, hub and cloud tokens): the basics a program expects (``PATH``, ``HOME``,
``USER``, ``LOGNAME``, ``SHELL``, ``TERM``, ``TMPDIR``, ``LANG``, ``LANGUAGE``,
``LC_*``, ``TZ``), the names the user lists (``agent.harness.env``), and
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``: its session's URL and that session's own
key. The prompt goes on stdin (an environment variable over 128 KiB cannot be passed
to exec at all).

**User.** When the trainer runs as root, the command runs under a uid of its own
(:mod:`rlpost.rollout.episodes.harness_user`), with ``HOME`` and ``TMPDIR`` a private directory:
no other harness can read its key from ``/proc/PID/environ``.

**Scratch space.** Each command gets a ``/tmp`` and ``/dev/shm`` of its own (fresh tmpfs in
a mount namespace of its own, ``TMPDIR`` pointing there), so no episode reads what another
left; where the kernel allows no mount namespace (a trainer that is not root, with
unprivileged user namespaces off) commands share the host's, and the run says so once.

**Descendants.** The command runs under :mod:`rlpost.rollout.episodes.harness_reaper`, a
child subreaper in its own process group: whatever the command started (background
jobs, ``setsid`` daemons) is killed when the command exits, when it is killed for
running past its time, and when the trainer dies.

**Output.** stdout and stderr are read as they come and only their tails kept
(``STDOUT_TAIL`` and ``STDERR_TAIL`` bytes); the bytes dropped are counted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from rlpost.rollout.episodes import harness_user

BASIC_ENV = tuple("PATH HOME USER LOGNAME SHELL TERM TMPDIR LANG LANGUAGE TZ".split())
STDOUT_TAIL = 1 << 20  # the answer is the last line: a tail keeps it
STDERR_TAIL = 64 << 10
REAPER = Path(__file__).with_name("harness_reaper.py")
KILL_WAIT_S = 10.0  # for the reaper to kill and reap the command's tree
log = logging.getLogger(__name__)


def harness_env(
    base_url: str, key: str, names: tuple[str, ...] = (), environ: dict | None = None
) -> dict[str, str]:
    """The environment of one harness process (``names``: the user's extra variables)."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k in BASIC_ENV or k.startswith("LC_") or k in names}
    env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"] = base_url, key
    return env


@functools.cache
def private_scratch() -> bool:
    """Whether the reaper can give commands a private /tmp and /dev/shm here (probed once)."""
    argv = [sys.executable, "-I", "-S", str(REAPER), str(os.getpid()), "-", "private"]
    done = subprocess.run(
        [*argv, sys.executable, "-I", "-S", "-c", ""], capture_output=True, timeout=60
    )
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        log.warning(
            "harness commands share /tmp and /dev/shm here: %s; run the trainer as "
            "root or allow unprivileged user namespaces",
            why,
        )
    return done.returncode == 0


class Tail:
    """The last ``limit`` bytes of a stream, and how many came before them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.dropped, self.buf = limit, 0, bytearray()

    def read(self, stream) -> None:
        while chunk := stream.read(1 << 16):
            self.buf += chunk
            if len(self.buf) > 2 * self.limit:  # trim in bulk: amortised O(1) per byte
                cut = len(self.buf) - self.limit
                self.dropped += cut
                del self.buf[:cut]

    def text(self) -> str:
        cut = max(0, len(self.buf) - self.limit)
        self.dropped += cut
        del self.buf[:cut]
        return self.buf.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str  # its tail
    stderr: str  # its tail
    dropped: int  # output bytes not kept, both streams


class HarnessProcess:
    """One harness command, started under the reaper in its own process group; with
    ``own_user`` (and a root trainer), under a uid of its own."""

    def __init__(self, command: tuple[str, ...], env: dict[str, str], own_user: bool = True):
        self.user = harness_user.reserve() if own_user and harness_user.isolates() else None
        uid, scratch = "-", "private" if private_scratch() else "shared"
        if scratch == "private":  # the trainer's TMPDIR may be under the /tmp it no longer sees
            env = {**env, "TMPDIR": "/tmp"}
        if self.user is not None:
            uid, env = str(self.user.uid), {**env, "HOME": str(self.user.home)}
            env["TMPDIR"] = str(self.user.home)
        argv = [sys.executable, "-I", "-S", str(REAPER), str(os.getpid()), uid, scratch, *command]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
                start_new_session=True,
            )
        except BaseException:
            self._release()
            raise

    def run(self, stdin: str) -> Finished:
        """Feed ``stdin``, read both outputs' tails and wait for the command's tree to end."""
        out, err = Tail(STDOUT_TAIL), Tail(STDERR_TAIL)
        threads = [
            threading.Thread(target=_feed, args=(self.proc.stdin, stdin.encode()), daemon=True),
            threading.Thread(target=err.read, args=(self.proc.stderr,), daemon=True),
        ]
        try:
            for t in threads:
                t.start()
            out.read(self.proc.stdout)
            for t in threads:
                t.join()
            code = self.proc.wait()
        finally:
            self._release()
        stdout, stderr = out.text(), err.text()
        return Finished(code, stdout, stderr, out.dropped + err.dropped)

    def _release(self) -> None:
        """Free the uid once nothing of the command's runs (the reaper has exited)."""
        if self.user is not None and (
            getattr(self, "proc", None) is None or self.proc.poll() is not None
        ):
            self.user.release()
            self.user = None

    def kill(self) -> None:
        """Have the reaper kill the command's whole tree; the process group as a fallback."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _feed(stream, data: bytes) -> None:
    view = memoryview(data)
    with contextlib.suppress(OSError):  # a command that does not read its prompt
        while view:
            view = view[stream.write(view) :]
    with contextlib.suppress(OSError):
        stream.close()
