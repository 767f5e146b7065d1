"""A cgroup per sandboxed run: memory, processes and CPU bounded for the whole run.

Rlimits bound each process; a memory cgroup charges every page the run touches, shared
memory and kernel memory included. The groups live under this process's own, per controller
(v2 where delegated, else a writable v1 hierarchy), found once per process by a probe group.
The command line's ``sh -c`` writes its pid into each ``cgroup.procs`` and execs the rest, so
the sandbox is inside before untrusted code runs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids", "cpu", "cpuset")
# Processes of the sandbox's own chain (two bwrap monitors, bwrap's pid 1) and slack.
CHAIN_PIDS = 8
# CFS bandwidth: one CPU's worth per period.
CPU_PERIOD_US = 100_000
_REMOVE_WAIT_S = 2.0
_log = logging.getLogger(__name__)

# The join: write $$ into every cgroup.procs named before "--", then exec what follows.
JOIN_SCRIPT = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Controller:
    """One usable controller: its cgroup version and the group run groups are made under."""

    name: str
    version: int
    base: str


@dataclass(frozen=True)
class Setting:
    """One control file to write; an optional one is skipped when the kernel lacks it."""

    controller: str
    file: str
    value: str
    optional: bool = False


@dataclass(frozen=True)
class CgroupHost:
    """What this host allows: usable controllers, and why each other one is not."""

    usable: tuple[Controller, ...]
    missing: tuple[tuple[str, str], ...]

    def get(self, name: str) -> Controller | None:
        return next((c for c in self.usable if c.name == name), None)

    def reason(self, name: str) -> str:
        return dict(self.missing).get(name, "")


def settings(
    controllers: Mapping[str, Controller], *, memory_bytes: int, max_pids: int, cpu: int, mems: str
) -> list[Setting]:
    """The control files one run's groups get, in write order: swap off where accounted, and
    the parent's ``mems``, which a v1 cpuset needs first."""
    out: list[Setting] = []
    memory = controllers.get("memory")
    if memory is not None and memory.version == 2:
        out += [Setting("memory", "memory.max", str(memory_bytes))]
        out += [Setting("memory", "memory.swap.max", "0", optional=True)]
        # An OOM kill takes the whole run, not one process of it.
        out += [Setting("memory", "memory.oom.group", "1", optional=True)]
    elif memory is not None:
        out += [Setting("memory", "memory.limit_in_bytes", str(memory_bytes))]
        out += [Setting("memory", "memory.memsw.limit_in_bytes", str(memory_bytes), optional=True)]
        out += [Setting("memory", "memory.swappiness", "0", optional=True)]
    if "pids" in controllers:
        out += [Setting("pids", "pids.max", str(max_pids))]
    cpu_ctl = controllers.get("cpu")
    if cpu_ctl is not None and cpu_ctl.version == 2:
        out += [Setting("cpu", "cpu.max", f"{CPU_PERIOD_US} {CPU_PERIOD_US}")]
    elif cpu_ctl is not None:
        out += [Setting("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US))]
        out += [Setting("cpu", "cpu.cfs_quota_us", str(CPU_PERIOD_US))]
    cpuset = controllers.get("cpuset")
    if cpuset is not None:
        if cpuset.version == 1:
            out += [Setting("cpuset", "cpuset.mems", mems)]
        out += [Setting("cpuset", "cpuset.cpus", str(cpu))]
    return out


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """``(fstype, mount point, root, super options)`` of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append(
                    (tail[0], _unescape(fields[4]), _unescape(fields[3]), set(tail[2].split(",")))
                )
    return found


def _unescape(path: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _memberships() -> dict[str, str]:
    """Controller name (or ``""`` for v2) -> this process's group path."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                for name in parts[1].split(",") if parts[1] else [""]:
                    out[name] = parts[2]
    return out


def _group_dir(mount: str, root: str, path: str) -> str | None:
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None  # our group is outside what this mount shows
    relative = path[len(root) :] if root != "/" else path
    return os.path.normpath(os.path.join(mount, relative.lstrip("/")))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(value)


def _candidates() -> dict[str, tuple[Controller | None, str]]:
    """Per controller: where its run groups would go, or ``None`` and why not."""
    member = _memberships()
    out: dict[str, tuple[Controller | None, str]] = {
        name: (None, "no cgroup hierarchy has it") for name in CONTROLLERS
    }
    for fstype, mount, root, options in _mounts():
        if fstype == "cgroup2":
            base = _group_dir(mount, root, member[""]) if "" in member else None
            if base is not None:
                _v2_candidates(mount, base, out)
            continue
        for name in CONTROLLERS:
            if name in options and name in member and out[name][0] is None:
                base = _group_dir(mount, root, member[name])
                if base is not None:
                    out[name] = (Controller(name, 1, base), "")
    return out


def _v2_candidates(mount: str, own: str, out: dict[str, tuple[Controller | None, str]]) -> None:
    """A v2 group with processes cannot delegate controllers (the root group excepted), so
    run groups go under our own group when it delegates them, else beside it under its parent."""
    bases = [own] if own == mount else [own, os.path.dirname(own)]
    for name in CONTROLLERS:
        if out[name][0] is not None:
            continue
        for base in bases:
            try:
                delegated = _read(os.path.join(base, "cgroup.subtree_control")).split()
            except OSError:
                delegated = []
            if name in delegated:
                out[name] = (Controller(name, 2, base), "")
                break
        else:
            out[name] = (
                None,
                f"v2 {own} and its parent do not delegate it (cgroup.subtree_control)",
            )


@functools.cache
def detect() -> CgroupHost:
    """Which controllers can bound a run here, each proven by a probe group a process joined."""
    usable, missing = [], []
    for name, (controller, reason) in _candidates().items():
        if controller is not None:
            reason = _probe(controller)
        if controller is not None and not reason:
            usable.append(controller)
        else:
            missing.append((name, reason))
    return CgroupHost(tuple(usable), tuple(missing))


def _probe(controller: Controller) -> str:
    """Empty when a child group can be made, limited and joined under ``controller.base``."""
    sh = shutil.which("sh")
    if sh is None:
        return "no sh on PATH to join a group with"
    where = f"v{controller.version} {controller.base}"
    try:
        group = RunGroup.create(
            {controller.name: controller}, memory_bytes=64 << 20, max_pids=16, cpu=_any_cpu()
        )
    except OSError as exc:
        return f"{where}: {exc.strerror or exc}"
    try:
        joined = subprocess.run(
            [*group.join_argv(sh), "true"], capture_output=True, text=True, timeout=10
        )
    finally:
        group.close()
    if joined.returncode != 0:
        detail = joined.stderr.strip().splitlines()
        return f"{where}: cannot move a process in ({detail[-1] if detail else joined.returncode})"
    return ""


def _any_cpu() -> int:
    return min(os.sched_getaffinity(0))


class RunGroup:
    """The groups of one run, one per controller; ``close`` kills what is left and removes them."""

    def __init__(self, dirs: dict[str, tuple[Controller, str]]) -> None:
        self.dirs = dirs

    @classmethod
    def create(
        cls, controllers: Mapping[str, Controller], *, memory_bytes: int, max_pids: int, cpu: int
    ) -> RunGroup:
        """Make and limit the groups; ``OSError`` (after removing what was made) if any write fails."""
        name = f"rlpost-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        group = cls({})
        try:
            for controller in controllers.values():
                path = os.path.join(controller.base, name)
                os.mkdir(path)
                group.dirs[controller.name] = (controller, path)
            mems = _parent_mems(controllers.get("cpuset"))
            for item in settings(
                controllers, memory_bytes=memory_bytes, max_pids=max_pids, cpu=cpu, mems=mems
            ):
                group._apply(item)
        except BaseException:
            group.close()
            raise
        return group

    def _apply(self, item: Setting) -> None:
        path = os.path.join(self.dirs[item.controller][1], item.file)
        if item.optional and not os.path.exists(path):
            return
        try:
            _write(path, item.value)
        except OSError:
            if item.optional:
                return
            raise
        if not item.optional and _read(path).split() != item.value.split():
            raise OSError(
                errno.EINVAL, f"{path} reads {_read(path)!r} after writing {item.value!r}"
            )

    def join_argv(self, sh: str) -> list[str]:
        """The command prefix that moves itself into every group, then execs the rest."""
        procs = sorted({os.path.join(path, "cgroup.procs") for _, path in self.dirs.values()})
        return [sh, "-c", JOIN_SCRIPT, "rlpost-cgroup-join", *procs, "--"]

    def oom_kills(self) -> int:
        """Processes the kernel killed because the run reached its memory limit."""
        entry = self.dirs.get("memory")
        if entry is None:
            return 0
        controller, path = entry
        source = "memory.events" if controller.version == 2 else "memory.oom_control"
        try:
            lines = _read(os.path.join(path, source)).splitlines()
        except OSError:
            return 0
        counts = dict(line.split(maxsplit=1) for line in lines if " " in line)
        return int(counts.get("oom_kill", "0"))

    def close(self) -> None:
        """Kill any process still in the groups and remove them; never raises."""
        for controller, path in self.dirs.values():
            _kill_all(controller, path)
        for _, path in self.dirs.values():
            _remove(path)
        self.dirs.clear()


def swap_accounted(memory: Controller | None) -> bool:
    """Whether run groups under ``memory`` can keep the run out of swap."""
    if memory is None:
        return False
    name = "memory.swap.max" if memory.version == 2 else "memory.memsw.limit_in_bytes"
    return os.path.exists(os.path.join(memory.base, name))


def _parent_mems(cpuset: Controller | None) -> str:
    if cpuset is None or cpuset.version != 1:
        return ""
    return _read(os.path.join(cpuset.base, "cpuset.mems")) or _read(
        os.path.join(cpuset.base, "cpuset.effective_mems")
    )


def _kill_all(controller: Controller, path: str) -> None:
    if controller.version == 2 and os.path.exists(os.path.join(path, "cgroup.kill")):
        with contextlib.suppress(OSError):
            _write(os.path.join(path, "cgroup.kill"), "1")
        return
    with contextlib.suppress(OSError):
        for pid in _read(os.path.join(path, "cgroup.procs")).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _remove(path: str) -> None:
    # A killed process stays listed until it is reaped, so rmdir may be busy for a moment.
    deadline = time.monotonic() + _REMOVE_WAIT_S
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                _log.warning("sandbox cgroup %s not removed: %s", path, exc.strerror)
                return
            time.sleep(0.01)
