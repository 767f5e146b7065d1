"""Per-run limits without bubblewrap: the seccomp program (loaded into a real child
process), the cgroup control values, the plan that picks between them, the join
launcher, and the command line carrying both. Runs on CPU in about a second.
"""

from __future__ import annotations

import os
import platform
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.rewards.sandbox import SandboxConfig, SandboxUnavailable, seccomp
from rlpost.rewards.sandbox.cgroup import (
    JOIN_SCRIPT,
    CgroupHost,
    Controller,
    RunGroup,
    Setting,
    _group_dir,
    _unescape,
    settings,
)
from rlpost.rewards.sandbox.command import Interpreter, Tools, build_command
from rlpost.rewards.sandbox.plan import make_plan

REPO = Path(__file__).resolve().parents[2]

# Loads the filter with prctl in a fresh interpreter, then reports what each call did.
_LOADER = r"""
import ctypes, errno, os, sys
from rlpost.rewards.sandbox.seccomp import build_filter
program = build_filter(sys.argv[1].split(","))
libc = ctypes.CDLL(None, use_errno=True)
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
buffer = ctypes.create_string_buffer(program, len(program))
fprog = Fprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_char_p))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER
def report(name, fn):
    try:
        fn()
        print(name, "allowed")
    except OSError as exc:
        print(name, errno.errorcode[exc.errno])
report("memfd_create", lambda: os.close(os.memfd_create("x")))
report("sched_setaffinity", lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))
sid = libc.shmget(0, 4096, 0o1600)
print("shmget", "allowed" if sid >= 0 else errno.errorcode[ctypes.get_errno()])
if sid >= 0:
    libc.shmctl(sid, 0, None)
report("open", lambda: open(sys.executable, "rb").close())
print("getpid", "allowed" if os.getpid() > 0 else "?")
import fcntl, socket
r, w = os.pipe()
report("F_GETFL", lambda: fcntl.fcntl(w, fcntl.F_GETFL))
report("F_SETPIPE_SZ", lambda: fcntl.fcntl(w, 1031, 1 << 20))
source = open(sys.executable, "rb")
report("splice", lambda: os.splice(source.fileno(), w, 4096, offset_src=0))
report("sendfile", lambda: os.sendfile(w, source.fileno(), 0, 4096))
report("socketpair", lambda: [s.close() for s in socket.socketpair()])
report("AF_UNIX", lambda: socket.socket(socket.AF_UNIX).close())
report("AF_INET", lambda: socket.socket(socket.AF_INET).close())
report("keyctl", lambda: os.strerror(0) if libc.syscall(int(sys.argv[2]), 0, -3, 0) > 0
       else (_ for _ in ()).throw(OSError(ctypes.get_errno(), "keyctl")))
"""


def _load_and_try(blocked: list[str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    keyctl = seccomp.ARCHES[platform.machine()].numbers["keyctl"]
    proc = subprocess.run(
        [sys.executable, "-c", _LOADER, ",".join(blocked), str(keyctl)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split() for line in proc.stdout.splitlines())


@pytest.mark.skipif(not seccomp.supported(), reason="no seccomp table for this machine")
def test_filter_refuses_kernel_memory_affinity_and_keyrings_and_allows_the_rest() -> None:
    seen = _load_and_try(
        [
            *seccomp.SHARED_MEMORY_CALLS,
            *seccomp.KERNEL_MEMORY_CALLS,
            *seccomp.AFFINITY_CALLS,
            *seccomp.KEYRING_CALLS,
        ]
    )
    assert seen == {
        "memfd_create": "EPERM",
        "sched_setaffinity": "EPERM",
        "shmget": "EPERM",
        "open": "allowed",
        "getpid": "allowed",
        # Only one fcntl command is refused: the one that grows a pipe's kernel buffer.
        "F_GETFL": "allowed",
        "F_SETPIPE_SZ": "EPERM",
        # A pipe holds pages given to it by reference past their unmapping or truncation.
        "splice": "EPERM",
        "sendfile": "EPERM",
        "socketpair": "EPERM",
        "AF_UNIX": "EPERM",
        "AF_INET": "EPERM",
        "keyctl": "EPERM",
    }


@pytest.mark.skipif(not seccomp.supported(), reason="no seccomp table for this machine")
def test_filter_refuses_network_sockets_but_keeps_unix_ones() -> None:
    seen = _load_and_try(list(seccomp.NETWORK_SOCKET_CALLS))
    assert (seen["AF_INET"], seen["AF_UNIX"], seen["socketpair"]) == ("EPERM", "allowed", "allowed")
    assert (seen["F_SETPIPE_SZ"], seen["keyctl"]) == ("allowed", "allowed")


@pytest.mark.skipif(not seccomp.supported(), reason="no seccomp table for this machine")
def test_filter_refuses_only_what_it_lists() -> None:
    seen = _load_and_try(list(seccomp.AFFINITY_CALLS))
    assert (seen["sched_setaffinity"], seen["memfd_create"], seen["shmget"]) == (
        "EPERM",
        "allowed",
        "allowed",
    )


def _decode(program: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_filter_checks_the_abi_before_the_number(machine: str) -> None:
    arch = seccomp.ARCHES[machine]
    insns = _decode(seccomp.build_filter(["memfd_create", "shmget"], machine))
    # Load the arch, kill any other ABI, then load the number.
    assert insns[0] == (0x20, 0, 0, 4) and insns[1] == (0x15, 1, 0, arch.audit)
    assert insns[2] == (0x06, 0, 0, seccomp.RET_KILL_PROCESS) and insns[3] == (0x20, 0, 0, 0)
    compared = [k for code, _, _, k in insns if code == 0x15][1:]
    assert compared == sorted([arch.numbers["memfd_create"], arch.numbers["shmget"]])
    assert insns[-1] == (0x06, 0, 0, seccomp.RET_ALLOW)
    refusals = [
        k for code, _, _, k in insns if code == 0x06 and k & 0xFFFF0000 == seccomp.RET_ERRNO
    ]
    assert refusals == [seccomp.RET_ERRNO | seccomp.EPERM] * 2
    x32 = [k for code, _, _, k in insns if code == 0x35]
    assert x32 == ([0x40000000] if machine == "x86_64" else [])


# The tables against the kernel's own headers, where this machine has them.
_HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_syscall_numbers_match_the_kernel_headers(machine: str) -> None:
    header = _HEADERS[machine]
    if not header.is_file():
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    # asm-generic names the calls with a 64-bit and a 32-bit variant __NR3264_* (fcntl).
    defined = dict(re.findall(r"#define __NR(?:3264)?_(\w+) (\d+)", header.read_text()))
    table = seccomp.ARCHES[machine].numbers
    assert {name: int(defined[name]) for name in table} == table
    groups = [
        seccomp.SHARED_MEMORY_CALLS,
        seccomp.KERNEL_MEMORY_CALLS,
        seccomp.AFFINITY_CALLS,
        seccomp.KEYRING_CALLS,
    ]
    rules = {seccomp.ARGUMENT_RULES[name][0] for name in seccomp.ARGUMENT_RULES}
    named = {name for group in groups for name in group if name not in seccomp.ARGUMENT_RULES}
    assert named | rules == set(table) | ({"inotify_init"} - set(table))


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_every_group_builds_on_every_machine(machine: str) -> None:
    everything = [
        *seccomp.SHARED_MEMORY_CALLS,
        *seccomp.KERNEL_MEMORY_CALLS,
        *seccomp.NETWORK_SOCKET_CALLS,
        *seccomp.AFFINITY_CALLS,
        *seccomp.KEYRING_CALLS,
    ]
    compared = {k for code, _, _, k in _decode(seccomp.build_filter(everything, machine))[3:]}
    numbers = seccomp.ARCHES[machine].numbers
    # inotify_init exists on x86_64 only; a whole-call refusal of socket wins over its rule.
    assert {numbers[name] for name in numbers} <= compared
    assert 1 not in compared  # no AF_UNIX comparison: socket is refused whole


def test_filter_refuses_an_argument_only_for_its_value() -> None:
    insns = _decode(seccomp.build_filter(["fcntl(F_SETPIPE_SZ)"], "x86_64"))
    # After the ABI checks: is it fcntl? load args[1]'s low word; 1031 refuses, else allow.
    assert insns[-6:] == [
        (0x15, 0, 4, 72),
        (0x20, 0, 0, 24),
        (0x15, 1, 0, 1031),
        (0x06, 0, 0, seccomp.RET_ALLOW),
        (0x06, 0, 0, seccomp.RET_ERRNO | seccomp.EPERM),
        (0x06, 0, 0, seccomp.RET_ALLOW),
    ]


def test_filter_refuses_an_unknown_machine_or_call() -> None:
    with pytest.raises(ValueError, match="no seccomp syscall table for riscv64"):
        seccomp.build_filter(["memfd_create"], "riscv64")
    with pytest.raises(ValueError, match="no syscall number for mmap"):
        seccomp.build_filter(["mmap"], "x86_64")


V1 = {
    name: Controller(name, 1, f"/cg/{name}/trainer") for name in ("memory", "pids", "cpu", "cpuset")
}
V2 = {name: Controller(name, 2, "/cg/trainer") for name in ("memory", "pids", "cpu", "cpuset")}


def test_settings_v1_limit_memory_without_swap_processes_quota_and_cpu() -> None:
    got = settings(V1, memory_bytes=256 << 20, max_pids=24, cpu=3, mems="0")
    assert got == [
        Setting("memory", "memory.limit_in_bytes", str(256 << 20)),
        Setting("memory", "memory.memsw.limit_in_bytes", str(256 << 20), optional=True),
        Setting("memory", "memory.swappiness", "0", optional=True),
        Setting("pids", "pids.max", "24"),
        Setting("cpu", "cpu.cfs_period_us", "100000"),
        Setting("cpu", "cpu.cfs_quota_us", "100000"),
        Setting("cpuset", "cpuset.mems", "0"),
        Setting("cpuset", "cpuset.cpus", "3"),
    ]


def test_settings_v2_and_only_for_the_controllers_given() -> None:
    got = settings(V2, memory_bytes=1 << 30, max_pids=72, cpu=0, mems="")
    assert [(s.file, s.value) for s in got] == [
        ("memory.max", str(1 << 30)),
        ("memory.swap.max", "0"),
        ("memory.oom.group", "1"),
        ("pids.max", "72"),
        ("cpu.max", "100000 100000"),
        ("cpuset.cpus", "0"),
    ]
    only_pids = settings({"pids": V2["pids"]}, memory_bytes=1, max_pids=9, cpu=0, mems="")
    assert only_pids == [Setting("pids", "pids.max", "9")]


FULL = CgroupHost(tuple(V1.values()), ())


def _host_without(*names: str) -> CgroupHost:
    usable = tuple(c for c in V1.values() if c.name not in names)
    return CgroupHost(usable, tuple((name, "not writable") for name in names))


def test_plan_uses_the_cgroup_for_everything_it_covers() -> None:
    plan = make_plan("auto", FULL, seccomp_supported=True)
    assert {c.name for c in plan.controllers} == {"memory", "pids", "cpu", "cpuset"}
    # v1 charges unix socket buffers, not TCP or UDP ones; keyrings are refused everywhere.
    assert plan.blocked == seccomp.NETWORK_SOCKET_CALLS + seccomp.KEYRING_CALLS
    v2 = make_plan("auto", CgroupHost(tuple(V2.values()), ()), seccomp_supported=True)
    assert v2.blocked == seccomp.KEYRING_CALLS and v2.seccomp_program is not None


def test_plan_refuses_by_seccomp_what_the_host_does_not_bound() -> None:
    memory = seccomp.SHARED_MEMORY_CALLS + seccomp.KERNEL_MEMORY_CALLS
    no_memory = make_plan("auto", _host_without("memory"), seccomp_supported=True)
    assert no_memory.blocked == memory + seccomp.KEYRING_CALLS
    no_cpuset = make_plan("auto", _host_without("cpuset"), seccomp_supported=True)
    assert no_cpuset.blocked == (
        seccomp.NETWORK_SOCKET_CALLS + seccomp.AFFINITY_CALLS + seccomp.KEYRING_CALLS
    )
    forced = make_plan("seccomp", CgroupHost((), ()), seccomp_supported=True)
    assert forced.controllers == ()
    assert forced.blocked == memory + seccomp.AFFINITY_CALLS + seccomp.KEYRING_CALLS
    assert forced.seccomp_program is not None
    none = make_plan("none", FULL, seccomp_supported=True)
    assert none.controllers == () and none.seccomp_program is None


def test_plan_fails_closed_when_its_limits_cannot_hold() -> None:
    with pytest.raises(SandboxUnavailable) as info:
        make_plan("cgroup", _host_without("pids"), seccomp_supported=True)
    message = str(info.value)
    assert "run_limits=cgroup: no usable pids cgroup (pids: not writable)" in message
    assert "\n" not in message
    for host in (_host_without("memory"), FULL):
        with pytest.raises(SandboxUnavailable, match="no seccomp filter for this machine"):
            make_plan("auto", host, seccomp_supported=False)
    assert make_plan("none", FULL, seccomp_supported=False).blocked == ()


def test_group_paths_follow_the_mount_root() -> None:
    assert _group_dir("/sys/fs/cgroup/memory", "/", "/a/b") == "/sys/fs/cgroup/memory/a/b"
    assert _group_dir("/sys/fs/cgroup/pids", "/", "/") == "/sys/fs/cgroup/pids"
    assert _group_dir("/cg", "/docker/x", "/docker/x/y") == "/cg/y"
    assert _group_dir("/cg", "/docker/x", "/other") is None
    assert _unescape("/a\\040b\\134c") == "/a b\\c"


def test_join_writes_its_own_pid_then_execs(tmp_path: Path) -> None:
    first, second = tmp_path / "a.procs", tmp_path / "b.procs"
    group = RunGroup({"pids": (V1["pids"], "/cg/pids/run"), "cpu": (V1["cpu"], "/cg/cpu/run")})
    argv = [
        "sh",
        "-c",
        JOIN_SCRIPT,
        "join",
        str(first),
        str(second),
        "--",
        sys.executable,
        "-c",
        "import os; print(os.getpid())",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    pid = proc.stdout.strip()
    assert first.read_text().strip() == pid and second.read_text().strip() == pid
    assert group.join_argv("/bin/sh") == [
        "/bin/sh",
        "-c",
        JOIN_SCRIPT,
        "rlpost-cgroup-join",
        "/cg/cpu/run/cgroup.procs",
        "/cg/pids/run/cgroup.procs",
        "--",
    ]


def test_join_that_cannot_write_never_runs_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    argv = ["sh", "-c", JOIN_SCRIPT, "join", str(tmp_path / "missing" / "cgroup.procs"), "--"]
    proc = subprocess.run([*argv, "touch", str(marker)], capture_output=True, timeout=30)
    assert proc.returncode == 125 and not marker.exists()


def test_command_joins_first_and_gives_bwrap_the_filter(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    tools = Tools("/usr/bin/bwrap", "/usr/bin/prlimit", "/usr/bin/taskset", "/usr/bin/setpriv")
    join = ["/bin/sh", "-c", JOIN_SCRIPT, "rlpost-cgroup-join", "/cg/x/cgroup.procs", "--"]
    argv = build_command(
        tools,
        Interpreter(None, "/usr/bin/python3"),
        SandboxConfig(),
        cpu=1,
        files=[(7, "main.py")],
        info_fd=5,
        argv=["main.py"],
        join=join,
        seccomp_fd=9,
    )
    assert argv[: len(join)] == join
    assert argv[len(join) : len(join) + 3] == ["/usr/bin/taskset", "--cpu-list", "1"]
    setpriv = argv.index("/usr/bin/setpriv")
    # The filter belongs to the inner bwrap, the one that runs the program.
    assert argv.index("--seccomp") > setpriv and argv[argv.index("--seccomp") + 1] == "9"
