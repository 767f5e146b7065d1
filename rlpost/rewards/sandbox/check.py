"""``rlpost sandbox check``: which limits hold on this host, one line each, each one probed.

Probe programs in the real sandbox report what they can reach and try to pass small memory and
process caps; a promise of the plan the probes contradict fails the check."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass

from rlpost.rewards.sandbox import seccomp
from rlpost.rewards.sandbox.cgroup import CHAIN_PIDS, swap_accounted
from rlpost.rewards.sandbox.command import SANDBOX_UID, caps_files, find_tools
from rlpost.rewards.sandbox.limits import RunLimits, SandboxConfig, SandboxResult
from rlpost.rewards.sandbox.plan import RunPlan, plan
from rlpost.rewards.sandbox.runner import check_available, run_code

PROBE = r"""
import ctypes, errno, fcntl, json, os, socket, sys
host = json.loads(sys.stdin.read())
out = {}
def attempt(key, fn):
    try:
        fn()
        out[key] = "allowed"
    except OSError as exc:
        out[key] = errno.errorcode.get(exc.errno, str(exc.errno))
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(key, name, *args, fd=True):
    got = libc.syscall(ctypes.c_long(host["nr"][name]), *args)
    out[key] = "allowed" if got >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    if got >= 0 and fd:
        os.close(got)
attempt("memfd", lambda: os.close(os.memfd_create("probe")))
sid = libc.shmget(0, 4096, 0o1600)
out["shm"] = "allowed" if sid >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
if sid >= 0:
    libc.shmctl(sid, 0, None)
attempt("socketpair", lambda: [end.close() for end in socket.socketpair()])
attempt("tcp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
pipe = os.pipe()
attempt("pipe_size", lambda: fcntl.fcntl(pipe[1], 1031, 1 << 20))  # F_SETPIPE_SZ
with open("/tmp/probe", "wb+") as f:  # a file's pages handed to a pipe by reference
    f.write(b"x" * 4096), f.flush()
    attempt("splice", lambda: os.splice(f.fileno(), pipe[1], 4096, offset_src=0))
    attempt("sendfile", lambda: os.sendfile(pipe[1], f.fileno(), 0, 4096))
os.unlink("/tmp/probe")  # the file count below starts from an empty /tmp
os.write(pipe[1], b"x")
call("tee", "tee", ctypes.c_long(pipe[0]), ctypes.c_long(os.pipe()[1]), ctypes.c_long(1),
     ctypes.c_long(2), fd=False)
call("io_uring", "io_uring_setup", ctypes.c_long(1), ctypes.create_string_buffer(120))
call("io_setup", "io_setup", ctypes.c_long(1), ctypes.byref(ctypes.c_ulong(0)), fd=False)
call("userfaultfd", "userfaultfd", ctypes.c_long(0))
call("memfd_secret", "memfd_secret", ctypes.c_long(0))
call("inotify", "inotify_init1", ctypes.c_long(0))
call("mq_open", "mq_open", b"probe", ctypes.c_long(os.O_CREAT | os.O_RDWR),
     ctypes.c_long(0o600), None)
# KEYCTL_GET_KEYRING_ID of KEY_SPEC_SESSION_KEYRING: the keyring the sandbox inherited.
call("keyctl", "keyctl", ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0), fd=False)
attempt("affinity", lambda: os.sched_setaffinity(0, host["cpus"]))
out["cpus"] = len(os.sched_getaffinity(0))
with open("/proc/net/dev") as dev:
    out["interfaces"] = [line.split(":")[0].strip() for line in dev.readlines()[2:]]
attempt("connect", lambda: socket.create_connection(("192.0.2.1", 80), timeout=1).close())
attempt("write_root", lambda: open("/probe", "w").close())
out["files"], out["files_stop"] = 0, "none"
try:
    while out["files"] < host["files"] + 64:
        open(f"/tmp/file-{out['files']}", "w").close()
        out["files"] += 1
except OSError as exc:
    out["files_stop"] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(out))
"""
# The calls PROBE makes by number, as the filter knows them.
PROBE_CALLS = ("io_uring_setup", "io_setup", "userfaultfd", "memfd_secret", "inotify_init1")
PROBE_CALLS += ("mq_open", "keyctl", "tee")

# Holds memfd memory past the limit, 8 MiB at a time.
HOLD_MEMORY = r"""
import os
held = []
while True:
    fd = os.memfd_create("held")
    os.posix_fallocate(fd, 0, 8 << 20)
    held.append(fd)
    print("memfd", len(held) * 8, flush=True)
"""
# Forks sleeping children until the process cap refuses one.
FORK = r"""
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
except OSError:
    print("forks", children, flush=True)
"""
# Fills socket buffers (stdin: "unix" or "tcp"), each raised to the most the host allows.
SOCKET_BUFFERS = r"""
import errno, socket, sys
kind = sys.stdin.read().strip()
held, sent, chunk = [], 0, b"x" * 65536
try:
    if kind == "tcp":
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(512)
    while True:
        if kind == "tcp":
            ends = [socket.create_connection(server.getsockname()), server.accept()[0]]
        else:
            ends = list(socket.socketpair())
        held += ends
        for end in ends:
            try:
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
            except OSError:
                pass
            end.setblocking(False)
            try:
                while True:
                    sent += end.send(chunk)
            except BlockingIOError:
                pass
        print("held", sent >> 20, flush=True)
except OSError as exc:
    print("stopped", errno.errorcode.get(exc.errno, exc.errno), flush=True)
print("held", sent >> 20, flush=True)
"""
# Pins huge pages in pipes past unmapping (vmsplice), in `processes` processes up to `mb` MiB
# each; prints the MiB held and how each process ended.
PIN_PAGES = r"""
import ctypes, errno, json, os, sys
ask, held_r, held_w, wait_r, wait_w = json.loads(sys.stdin.read()), *os.pipe(), *os.pipe()
libc, P, Z = ctypes.CDLL(None, use_errno=True), ctypes.c_void_p, ctypes.c_size_t
libc.mmap.restype, libc.mmap.argtypes = P, [P, Z, ctypes.c_int, ctypes.c_int, ctypes.c_int, Z]
libc.munmap.argtypes, libc.madvise.argtypes = [P, Z], [P, Z, ctypes.c_int]
libc.vmsplice.restype = ctypes.c_long
HUGE, SPAN = 2 << 20, 8 << 20
class Iovec(ctypes.Structure):
    _fields_ = [("base", P), ("len", Z)]
def huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
def pin(target, held=0, pipe=-1):
    while held < target:
        addr = libc.mmap(None, SPAN, 3, 0x22, -1, 0)  # read/write, private and anonymous
        if addr in (None, P(-1).value):
            return held, errno.errorcode[ctypes.get_errno()]
        libc.madvise(addr, SPAN, 14)  # MADV_HUGEPAGE
        tops, before = range(-(-addr // HUGE) * HUGE, addr + SPAN - HUGE + 1, HUGE), huge_kb()
        for top in tops:
            ctypes.memset(top, 1, 1)
        each = HUGE if (huge_kb() - before) << 10 >= len(tops) * HUGE else 4096
        try:
            for top in tops:
                while libc.vmsplice(pipe, ctypes.byref(Iovec(top, 4096)), 1, 2) < 0:
                    if ctypes.get_errno() not in (errno.EAGAIN, errno.EBADF):
                        return held, errno.errorcode[ctypes.get_errno()]
                    pipe = os.pipe2(os.O_NONBLOCK)[1]  # this one is full
                held += each
        except OSError as exc:
            return held, errno.errorcode[exc.errno]
        finally:
            libc.munmap(addr, SPAN)
    return held, "held"
for _ in range(ask["processes"] - 1):
    if os.fork() == 0:  # holds what it pinned until the first process exits
        os.write(held_w, "{} {}\n".format(*pin(ask["mb"] << 20)).encode())
        os.close(held_w), os.close(wait_w), os.read(wait_r, 1), os._exit(0)
os.close(held_w)
ends = [pin(ask["mb"] << 20), *(line.split() for line in os.fdopen(held_r).read().splitlines())]
held = sum(int(held) for held, _ in ends) >> 20
print(json.dumps({"held_mb": held, "vmsplice": [end for _, end in ends]}))
"""
PROBE_MEMORY_MB = 64
PROBE_PROCESSES = 8
PIN_PROCESSES = 2


@dataclass(frozen=True)
class Line:
    """One limit: its name, how far it holds (per run, per process, none...), how, and whether
    the probes agree with the promise."""

    name: str
    scope: str
    detail: str
    ok: bool = True

    def render(self) -> str:
        return f"{self.name:<9} {self.scope:<11} {self.detail}" + ("" if self.ok else "  [MISSING]")


def run_check(mode: RunLimits) -> list[Line]:
    """Probe the sandbox under ``mode``; raises ``SandboxUnavailable`` when it cannot run."""
    check_available()
    limits = plan(mode)
    config = SandboxConfig(run_limits=mode, timeout_s=10)
    cpus = list(range(os.cpu_count() or 1))
    numbers = seccomp.ARCHES[platform.machine()].numbers if seccomp.supported() else {}
    host = {"cpus": cpus, "nr": {name: numbers.get(name, -1) for name in PROBE_CALLS}}
    host["files"] = config.max_tmp_files
    probe = run_code(PROBE, stdin=json.dumps(host), config=config)
    if probe.status != "ok":
        tail = (probe.stderr.strip().splitlines() or [probe.status])[-1]
        return [Line("probe", "failed", f"the probe program did not finish ({tail})", ok=False)]
    seen = json.loads(probe.stdout)
    small = SandboxConfig(
        run_limits=mode,
        timeout_s=10,
        memory_mb=PROBE_MEMORY_MB,
        max_processes=PROBE_PROCESSES,
    )
    # Without a memory cgroup nothing bounds held memfds but the refusal the first probe saw.
    memory = run_code(HOLD_MEMORY, config=small) if limits.controller("memory") else None
    ask = {"mb": 2 * PROBE_MEMORY_MB, "processes": PIN_PROCESSES}  # twice what each may hold
    pinned = run_code(PIN_PAGES, stdin=json.dumps(ask), config=small)
    forks = run_code(FORK, config=small)
    buffers = {kind: run_code(SOCKET_BUFFERS, stdin=kind, config=small) for kind in ("unix", "tcp")}
    tools = find_tools()
    started = f"bubblewrap {tools.bwrap}, as uid {SANDBOX_UID}, run_limits={mode}"
    return [
        Line("sandbox", "runs", started),
        _memory_line(limits, seen, memory, pinned),
        _kernel_line(limits, seen, buffers),
        _keyring_line(limits, seen),
        _processes_line(limits, forks.stdout),
        _cpu_line(limits),
        _cpuset_line(limits, seen, len(cpus)),
        _seccomp_line(limits),
        _network_line(seen),
        _root_line(seen, config),
        _files_line(seen, config, caps_files(tools)),
    ]


def _where(limits: RunPlan, name: str) -> str | None:
    controller = limits.controller(name)
    return None if controller is None else f"cgroup v{controller.version}"


def _why_not(limits: RunPlan, name: str) -> str:
    if limits.mode in ("seccomp", "none"):
        return f"run_limits={limits.mode} skips the cgroup"
    return f"no {name} cgroup: {limits.host.reason(name)}"


def _pinned(result: SandboxResult) -> tuple[int | None, str]:
    """The MiB a PIN_PAGES run held past unmapping (None: it was stopped), and how it ended."""
    if result.status != "ok":
        return None, f"stopped, status {result.status}"
    got = json.loads(result.stdout)
    return got["held_mb"], f"held {got['held_mb']} MiB, vmsplice {'/'.join(got['vmsplice'])}"


def _memory_line(
    limits: RunPlan, seen: dict, memory: SandboxResult | None, pin: SandboxResult
) -> Line:
    where = _where(limits, "memory")
    held, how = _pinned(pin)
    pinned = f"{PIN_PROCESSES} processes pinning pipe pages past unmapping: {how}"
    if memory is not None and where is not None:
        lines = memory.stdout.splitlines()
        most = max((int(line.split()[1]) for line in lines if line.startswith("memfd ")), default=0)
        status = memory.status
        ok = status == "memory" and most <= PROBE_MEMORY_MB and (held or 0) <= PROBE_MEMORY_MB
        swap = "swap off" if swap_accounted(limits.controller("memory")) else "swap not counted"
        detail = (
            f"{where}: memory_mb for the whole run, shared memory and tmpfs included, {swap} "
            f"(probe: stopped at {most} of {PROBE_MEMORY_MB} MiB of memfd, status {status}; "
            f"{pinned})"
        )
        return Line("memory", "per run", detail, ok)
    refused = "memfd_create" in limits.blocked and "vmsplice" in limits.blocked
    bound = PROBE_MEMORY_MB * PIN_PROCESSES
    ok = refused and seen["memfd"] == "EPERM" and seen["shm"] == "EPERM"
    ok = ok and held is not None and held <= bound
    how = "refused by seccomp" if refused else "NOT bounded"
    detail = (
        f"RLIMIT_AS memory_mb per process, so memory_mb x max_processes per run; memfd, SysV shm "
        f"and pipe page pinning {how} (probe: memfd {seen['memfd']}, shm {seen['shm']}; "
        f"{pinned}, bound {bound} MiB); {_why_not(limits, 'memory')}"
    )
    return Line("memory", "per process", detail, ok)


# What the probe reports for each kind of kernel memory the seccomp path refuses.
_KERNEL_PROBES = ("socketpair", "tcp", "pipe_size", "splice", "sendfile", "tee", "io_uring")
_KERNEL_PROBES += ("io_setup", "userfaultfd", "memfd_secret", "inotify", "mq_open")


def _held(result: SandboxResult) -> tuple[int, str]:
    """The most MiB of socket buffers a SOCKET_BUFFERS run held, and how it ended."""
    lines = result.stdout.splitlines()
    most = max((int(line.split()[1]) for line in lines if line.startswith("held ")), default=0)
    stopped = [line.split()[1] for line in lines if line.startswith("stopped ")]
    return most, stopped[0] if stopped else result.status


def _kernel_line(limits: RunPlan, seen: dict, buffers: dict[str, SandboxResult]) -> Line:
    held = {kind: _held(result) for kind, result in buffers.items()}
    ok = all(most <= PROBE_MEMORY_MB for most, _ in held.values())
    probe = ", ".join(f"{kind} {most} ({end})" for kind, (most, end) in held.items())
    probe = f"socket buffers held {probe} of {PROBE_MEMORY_MB} MiB"
    where = _where(limits, "memory")
    if where is not None:
        detail = f"{where}: socket and pipe buffers charged to the run"
        if "socket(not AF_UNIX)" in limits.blocked:  # cgroup v1 does not charge TCP or UDP
            detail += "; TCP/UDP sockets refused by seccomp"
        detail += f" ({probe})"
        return Line("kernel", "per run", detail, ok)
    refused = "socket" in limits.blocked
    ok = ok and refused and all(seen[key] == "EPERM" for key in _KERNEL_PROBES)
    calls = ", ".join(f"{key} {seen[key]}" for key in _KERNEL_PROBES)
    how = "refused by seccomp" if refused else "NOT bounded"
    detail = (
        f"sockets, pipe resizing and page passing, io_uring, AIO, userfaultfd, memfd_secret, "
        f"inotify, POSIX queues {how} "
        f"(probe: {calls}; {probe}); {_why_not(limits, 'memory')}"
    )
    return Line("kernel", "refused" if refused else "none", detail, ok)


def _keyring_line(limits: RunPlan, seen: dict) -> Line:
    refused = "keyctl" in limits.blocked
    detail = (
        "add_key, keyctl, request_key refused by seccomp: the session keyring is unreachable"
        if refused
        else "the program can read and clear the session keyring it inherits"
    )
    ok = refused and seen["keyctl"] == "EPERM"
    scope = "refused" if refused else "open"
    return Line("keyring", scope, f"{detail} (probe: keyctl {seen['keyctl']})", ok)


def _processes_line(limits: RunPlan, stdout: str) -> Line:
    forks = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("forks ")]
    ok = bool(forks) and forks[0] < PROBE_PROCESSES
    probe = f"probe: {forks[0] if forks else 'no'} forks under a cap of {PROBE_PROCESSES}"
    where = _where(limits, "pids")
    if where is not None:
        detail = f"{where} pids.max = max_processes + {CHAIN_PIDS}, and RLIMIT_NPROC ({probe})"
    else:
        detail = f"RLIMIT_NPROC counted in the run's own user namespace ({probe})"
    return Line("processes", "per run", detail, ok)


def _cpu_line(limits: RunPlan) -> Line:
    where = _where(limits, "cpu")
    if where is not None:
        return Line("cpu", "per run", f"{where} quota of one CPU, and RLIMIT_CPU per process")
    if limits.controller("cpuset") is None and "sched_setaffinity" not in limits.blocked:
        detail = f"RLIMIT_CPU per process; the pin can be widened; {_why_not(limits, 'cpu')}"
        return Line("cpu", "per process", detail, ok=False)
    return Line("cpu", "per run", f"one CPU by the pin (see cpuset); {_why_not(limits, 'cpu')}")


def _cpuset_line(limits: RunPlan, seen: dict, host_cpus: int) -> Line:
    ok = seen["cpus"] == 1
    probe = f"probe: asked for {host_cpus} CPUs ({seen['affinity']}), has {seen['cpus']}"
    where = _where(limits, "cpuset")
    if where is not None:
        return Line("cpuset", "per run", f"{where} cpuset.cpus: one CPU ({probe})", ok)
    if "sched_setaffinity" in limits.blocked:
        detail = f"taskset pin, sched_setaffinity refused by seccomp ({probe})"
        return Line("cpuset", "per run", detail, ok and seen["affinity"] == "EPERM")
    detail = f"taskset pin only, the program may widen it ({probe}); {_why_not(limits, 'cpuset')}"
    return Line("cpuset", "none", detail, ok=False)


def _seccomp_line(limits: RunPlan) -> Line:
    if limits.mode == "none":
        return Line("seccomp", "off", "run_limits=none loads no filter")
    if not limits.blocked:
        return Line("seccomp", "off", "not needed: the cgroup bounds shared memory and affinity")
    arch = "/".join(seccomp.ARCHES)
    detail = f"refuses {', '.join(limits.blocked)} with EPERM (other ABIs killed; {arch})"
    return Line("seccomp", "on", detail)


def _network_line(seen: dict) -> Line:
    ok = seen["interfaces"] == ["lo"] and seen["connect"] != "allowed"
    detail = (
        f"own network namespace (probe: interfaces {','.join(seen['interfaces'])}, "
        f"connect out {seen['connect']})"
    )
    return Line("network", "none", detail, ok)


def _root_line(seen: dict, config: SandboxConfig) -> Line:
    ok = seen["write_root"] != "allowed"
    detail = (
        f"read-only; writable only private /tmp and /dev/shm, {config.tmpfs_mb} MiB each "
        f"(probe: write to / {seen['write_root']})"
    )
    return Line("root", "read-only", detail, ok)


def _files_line(seen: dict, config: SandboxConfig, capped: bool) -> Line:
    made, stop = seen["files"], seen["files_stop"]
    if not capped:
        detail = (
            "not capped: without root or unprivileged user namespaces the tmpfs takes no file count "
            f"(a memory cgroup still charges their kernel memory; probe: made {made})"
        )
        return Line("files", "none", detail)
    detail = (
        f"at most {config.max_tmp_files} files, links and directories on each of /tmp and "
        f"/dev/shm (probe: stopped at {made}, {stop})"
    )
    return Line("files", "per mount", detail, made <= config.max_tmp_files)
