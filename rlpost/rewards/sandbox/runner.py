"""One run of untrusted Python inside the sandbox, supervised from the host.

Fail closed: without a working bubblewrap ``SandboxUnavailable`` names the cause and the fix.
The supervisor kills a run one byte past ``max_output_bytes`` or past its deadline, and at the
end kills the sandbox's pid 1, taking its pid namespace with it. Files arrive through memfds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import selectors
import signal
import subprocess
import threading
import time

from rlpost.rewards.sandbox.cgroup import CHAIN_PIDS, RunGroup
from rlpost.rewards.sandbox.command import (
    Interpreter,
    SandboxUnavailable,
    Tools,
    build_command,
    find_interpreter,
    find_tools,
)
from rlpost.rewards.sandbox.limits import SandboxConfig, SandboxResult, Status, classify
from rlpost.rewards.sandbox.plan import RunPlan, plan

MAIN_FILE = "main.py"
# unlike -I, the script's directory stays on sys.path, so ``files`` import
PYTHON_FLAGS = ("-E", "-s", "-S")
# the chain's whole environment: the sandbox's /proc/1/environ is bwrap's
_HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_READ_CHUNK = 1 << 16
_REAP_TIMEOUT_S = 5.0

_cpu_turn = itertools.count()
_probe_lock = threading.Lock()
_probed: set[tuple[str, str, int]] = set()


def check_available() -> None:
    """Raise ``SandboxUnavailable`` (one line: cause and fix) unless the sandbox works here."""
    tools = find_tools()
    interpreter = find_interpreter()
    key = (tools.bwrap, interpreter.executable, os.geteuid())
    if key in _probed:
        return
    with _probe_lock:
        if key in _probed:
            return
        # run_limits="none": this proves bwrap works; each run then plans its own limits.
        probe = SandboxConfig(timeout_s=20, run_limits="none")
        result = _execute(tools, interpreter, "print(6 * 7)", b"", probe, {})
        if result.status != "ok" or result.stdout.strip() != "42":
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            detail = lines[0] if lines else f"status {result.status}"
            raise SandboxUnavailable(
                f"bubblewrap cannot build the sandbox here ({detail}); user namespaces must be "
                "enabled (sysctl user.max_user_namespaces > 0) and bubblewrap installed "
                "(apt-get install -y bubblewrap)"
            )
        _probed.add(key)


def run_code(
    code: str,
    *,
    stdin: str = "",
    config: SandboxConfig | None = None,
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as main.py, with ``files`` beside it, in a fresh sandbox."""
    config = config or SandboxConfig()
    files = dict(files or {})
    for name in files:
        _check_file_name(name)
    check_available()
    return _execute(find_tools(), find_interpreter(), code, _encode(stdin), config, files)


def _check_file_name(name: str) -> None:
    parts = name.split("/")
    bad = (
        not name or "\0" in name or name.startswith("/") or any(p in ("", ".", "..") for p in parts)
    )
    if bad:
        raise ValueError(f"sandbox file name {name!r} must be a relative path without '.' or '..'")
    if name == MAIN_FILE:
        raise ValueError(f"sandbox file name {MAIN_FILE!r} is reserved for the program itself")


def _encode(text: str) -> bytes:
    # Model output can hold lone surrogates; a reward must never crash on them.
    return text.encode("utf-8", errors="replace")


def _pick_cpu(config: SandboxConfig) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    if config.cpu is None:
        return allowed[next(_cpu_turn) % len(allowed)]
    if config.cpu not in allowed:
        raise ValueError(f"sandbox cpu={config.cpu} is not one of this process's CPUs {allowed}")
    return config.cpu


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name.replace("/", "_"), os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _execute(
    tools: Tools,
    interpreter: Interpreter,
    code: str,
    stdin: bytes,
    config: SandboxConfig,
    files: dict[str, str],
) -> SandboxResult:
    cpu = _pick_cpu(config)
    limits = plan(config.run_limits)
    group = _run_group(limits, config, cpu)
    with contextlib.closing(group) if group is not None else contextlib.nullcontext():
        entries: list[tuple[int, str]] = []
        program = limits.seccomp_program
        seccomp_fd = _memfd("seccomp", program) if program is not None else None
        info_r, info_w = os.pipe()
        try:
            for name, text in [(MAIN_FILE, code), *files.items()]:
                entries.append((_memfd(name, _encode(text)), name))
            argv = build_command(
                tools,
                interpreter,
                config,
                cpu=cpu,
                files=entries,
                info_fd=info_w,
                argv=[*PYTHON_FLAGS, MAIN_FILE],
                join=group.join_argv(tools.sh or "sh") if group is not None else None,
                seccomp_fd=seccomp_fd,
            )
            start = time.monotonic()
            proc = subprocess.Popen(
                argv,
                **dict.fromkeys(("stdin", "stdout", "stderr"), subprocess.PIPE),
                pass_fds=(info_w, *(fd for fd, _ in entries), *{seccomp_fd} - {None}),
                start_new_session=True,
                env=_HOST_ENV,
                cwd="/",
            )
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
            for fd in [fd for fd, _ in entries] + ([] if seccomp_fd is None else [seccomp_fd]):
                os.close(fd)
        with _Supervisor(proc, info_r, config, deadline=start + config.timeout_s) as supervisor:
            stopped = supervisor.pump(stdin)
            out, err = bytes(supervisor.stdout), bytes(supervisor.stderr)
        oom_kills = group.oom_kills() if group is not None else 0
        status, exit_code = classify(proc.returncode, err, stopped, oom_kills)
        return SandboxResult(
            status=status,
            exit_code=exit_code,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            wall_seconds=time.monotonic() - start,
        )


def _run_group(limits: RunPlan, config: SandboxConfig, cpu: int) -> RunGroup | None:
    if not limits.controllers:
        return None
    try:
        return RunGroup.create(
            {c.name: c for c in limits.controllers},
            memory_bytes=config.memory_mb << 20,
            max_pids=config.max_processes + CHAIN_PIDS,
            cpu=cpu,
        )
    except OSError as exc:  # fail closed: never run with fewer limits than planned
        raise SandboxUnavailable(
            f"cannot make the run's cgroup ({exc.strerror or exc}); "
            "set run_limits=seccomp to run without one"
        ) from None


class _Supervisor:
    """Pipes, deadline and teardown of one running sandbox."""

    def __init__(self, proc: subprocess.Popen, info_r: int, config: SandboxConfig, deadline: float):
        self.proc = proc
        self.deadline = deadline
        self.limit = config.max_output_bytes
        self.stdout = bytearray()
        self.stderr = bytearray()
        self._info_r: int | None = info_r
        self._info = bytearray()
        self._pid1_fd: int | None = None
        self._selector = selectors.DefaultSelector()

    def __enter__(self) -> _Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        # Runs on every path, exceptions included: no sandbox outlives its run.
        self._kill()
        self._selector.close()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        for fd in (self._info_r, self._pid1_fd):
            if fd is not None:
                os.close(fd)

    def pump(self, stdin: bytes) -> Status | None:
        """Move data until both outputs close; return why the run was stopped, if it was."""
        sel = self._selector
        sel.register(self.proc.stdout, selectors.EVENT_READ, self.stdout)
        sel.register(self.proc.stderr, selectors.EVENT_READ, self.stderr)
        sel.register(self._info_r, selectors.EVENT_READ, self._info)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(self.proc.stdin.fileno(), False)
            sel.register(self.proc.stdin, selectors.EVENT_WRITE, None)
        else:
            self.proc.stdin.close()
        while self.proc.stdout in _registered(sel) or self.proc.stderr in _registered(sel):
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in sel.select(remaining):
                if key.data is None:
                    pending = self._feed(pending)
                elif key.data is self._info:
                    self._read_info()
                elif not self._read_output(key):
                    return "output_limit"
        try:
            self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            return "timeout"
        return None

    def _feed(self, pending: memoryview) -> memoryview:
        try:
            pending = pending[os.write(self.proc.stdin.fileno(), pending[:_READ_CHUNK]) :]
        except BlockingIOError:
            return pending
        except BrokenPipeError:  # the program exited or closed stdin without reading it all
            pending = pending[:0]
        if not pending:
            self._selector.unregister(self.proc.stdin)
            self.proc.stdin.close()
        return pending

    def _read_output(self, key: selectors.SelectorKey) -> bool:
        chunk = os.read(key.fd, _READ_CHUNK)
        if not chunk:
            self._selector.unregister(key.fileobj)
            return True
        buffer: bytearray = key.data
        room = self.limit - len(buffer)
        buffer += chunk[:room]
        return len(chunk) <= room

    def _read_info(self) -> None:
        chunk = os.read(self._info_r, _READ_CHUNK)
        self._info += chunk
        if chunk:
            try:
                pid = json.loads(self._info).get("child-pid")
            except ValueError:  # JSON not complete yet
                return
            if isinstance(pid, int):
                try:
                    self._pid1_fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    self._pid1_fd = None
        self._selector.unregister(self._info_r)
        os.close(self._info_r)
        self._info_r = None

    def _kill(self) -> None:
        if self._pid1_fd is not None:
            # pid 1 of the sandbox: its death kills the whole pid namespace.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pid1_fd, signal.SIGKILL)
        if self.proc.poll() is None:  # only while the group leader lives is the pgid ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._pid1_fd is not None:
            # readable once pid 1 exited, after every process of its namespace
            select.select([self._pid1_fd], [], [], _REAP_TIMEOUT_S)


def _registered(sel: selectors.BaseSelector) -> set[object]:
    return {key.fileobj for key in sel.get_map().values()}
