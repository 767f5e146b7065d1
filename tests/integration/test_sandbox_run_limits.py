"""Hostile programs against the per-run limits, in the real sandbox, on CPU.

Each test runs twice: with the run's own cgroup (``run_limits="cgroup"``,
skipped where the host gives none) and with the no-cgroup path forced
(``run_limits="seccomp"``). Memory no address space counts (memfd, SysV shm),
a fork or thread bomb, and a wider CPU affinity must each be stopped or
refused, and the host must be left as it was: no process, no cgroup behind.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from rlpost.rewards.sandbox import SandboxConfig, SandboxUnavailable, check_available, cli
from rlpost.rewards.sandbox import cgroup as cgroups
from rlpost.rewards.sandbox.runner import run_code
from tests.conftest import pids_with

pytestmark = pytest.mark.sandbox

LIMIT_MB = 128
# Four times the limit, 8 MiB a step (RLIMIT_FSIZE caps one memfd at 16 MiB).
STEPS = 4 * LIMIT_MB // 8


@pytest.fixture(autouse=True, scope="module")
def _sandbox_available() -> None:
    try:
        check_available()
    except SandboxUnavailable as exc:
        # CI sets RLPOST_REQUIRE_SANDBOX=1 so a broken sandbox fails instead of skipping.
        if os.environ.get("RLPOST_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox unavailable: {exc}")
        pytest.skip(f"sandbox unavailable: {exc}")


def _has_cgroup() -> bool:
    host = cgroups.detect()
    return host.get("memory") is not None and host.get("pids") is not None


def _skip_without_cgroup() -> None:
    if not _has_cgroup():
        reasons = "; ".join(f"{n}: {r}" for n, r in cgroups.detect().missing)
        pytest.skip(f"no per-run cgroup on this host ({reasons})")


@pytest.fixture(params=["cgroup", "seccomp"])
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "cgroup":
        _skip_without_cgroup()
    return request.param


@pytest.fixture
def cgroup_mode() -> str:
    """For what only a cgroup bounds: the run's total over many processes."""
    _skip_without_cgroup()
    return "cgroup"


def _config(mode: str, **overrides: object) -> SandboxConfig:
    return SandboxConfig(run_limits=mode, timeout_s=10.0, memory_mb=LIMIT_MB, **overrides)


def _leftover_groups() -> list[str]:
    prefix = f"rlpost-sandbox-{os.getpid()}-"
    return [
        os.path.join(c.base, name)
        for c in cgroups.detect().usable
        for name in os.listdir(c.base)
        if name.startswith(prefix)
    ]


def _host_unharmed() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0
    assert run_code("print('alive')").stdout == "alive\n"
    assert _leftover_groups() == []


def _held(stdout: str) -> int:
    steps = [int(line) for line in stdout.split() if line.isdigit()]
    return max(steps, default=0)


MEMFD = f"""
import os
held = []
for i in range({STEPS}):
    fd = os.memfd_create(f"m{{i}}")
    os.posix_fallocate(fd, 0, 8 << 20)
    held.append(fd)
    print((i + 1) * 8, flush=True)
print("HELD ALL", flush=True)
"""

SYSV_SHM = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for i in range({STEPS}):
    sid = libc.shmget(0, 8 << 20, 0o1600)
    if sid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    address = libc.shmat(sid, None, 0)
    ctypes.memset(address, 1, 8 << 20)
    libc.shmdt(ctypes.c_void_p(address))  # detached: in no process's address space any more
    print((i + 1) * 8, flush=True)
print("HELD ALL", flush=True)
"""


@pytest.mark.parametrize("program", [MEMFD, SYSV_SHM], ids=["memfd_fallocate", "sysv_shm"])
def test_shared_memory_beyond_the_limit_is_stopped_or_refused(mode: str, program: str) -> None:
    result = run_code(program, config=_config(mode))
    assert "HELD ALL" not in result.stdout
    if mode == "cgroup":
        # The cgroup charges the pages to the run and its OOM kill is the verdict.
        assert result.status == "memory"
        assert 0 < _held(result.stdout) <= LIMIT_MB
    else:
        assert (result.status, _held(result.stdout)) == ("error", 0)
        assert "PermissionError: [Errno 1]" in result.stderr
    _host_unharmed()


def test_memory_of_many_processes_is_bounded_per_run(cgroup_mode: str) -> None:
    # Six children of 40 MiB each: every one is under RLIMIT_AS, the run is not. The
    # program fails when the kernel kills one of them, which makes the verdict.
    code = (
        "import os, sys, time\n"
        "for i in range(6):\n"
        "    if os.fork() == 0:\n"
        "        block = bytearray(40 << 20)\n"
        "        time.sleep(5)\n"
        "        os._exit(0)\n"
        "pid, status = os.wait()\n"
        "sys.exit(9 if os.WIFSIGNALED(status) else 0)\n"
    )
    result = run_code(code, config=_config(cgroup_mode))
    assert (result.status, result.exit_code) == ("memory", 9)
    assert result.wall_seconds < 5  # killed at the limit, not at the children's own pace
    _host_unharmed()


FORKS = """
import os, time
count = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        count += 1
except OSError:
    print(count)
"""

THREADS = """
import threading, time
count = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        count += 1
except RuntimeError:
    print(count)
"""


@pytest.mark.parametrize("program", [FORKS, THREADS], ids=["processes", "threads"])
def test_fork_and_thread_bombs_stop_at_the_process_cap(mode: str, program: str) -> None:
    marker = f"rlpost-bomb-{uuid.uuid4().hex}"
    result = run_code(f"# {marker}\n" + program, config=_config(mode, max_processes=16))
    assert result.status == "ok", result.stderr
    assert 0 < int(result.stdout) < 16
    assert result.wall_seconds < 10  # the sleepers died with the run, not at their own pace
    assert not pids_with(marker)
    _host_unharmed()


def test_cpu_affinity_cannot_be_widened(mode: str) -> None:
    cpus = list(range(os.cpu_count() or 1))
    code = (
        "import os\n"
        "try:\n"
        f"    os.sched_setaffinity(0, {cpus!r})\n"
        "    print('set')\n"
        "except OSError as exc:\n"
        "    print('refused', exc.errno)\n"
        "print(len(os.sched_getaffinity(0)))\n"
    )
    result = run_code(code, config=_config(mode))
    assert result.status == "ok", result.stderr
    verdict, count = result.stdout.splitlines()
    assert count == "1"
    # A cpuset clamps the wider mask to its one CPU; seccomp refuses the call.
    assert verdict == ("set" if mode == "cgroup" else "refused 1")


def test_run_groups_carry_the_limits_and_are_removed(cgroup_mode: str) -> None:
    config = _config(cgroup_mode, max_processes=20)
    group = cgroups.RunGroup.create(
        {c.name: c for c in cgroups.detect().usable},
        memory_bytes=config.memory_mb << 20,
        max_pids=config.max_processes + cgroups.CHAIN_PIDS,
        cpu=0,
    )
    try:
        memory = group.dirs["memory"][1]
        limit_file = (
            "memory.max" if group.dirs["memory"][0].version == 2 else "memory.limit_in_bytes"
        )
        assert Path(memory, limit_file).read_text().strip() == str(LIMIT_MB << 20)
        assert Path(group.dirs["pids"][1], "pids.max").read_text().strip() == "28"
    finally:
        group.close()
    assert _leftover_groups() == []
    for _ in range(3):
        assert run_code("print(1)", config=config).stdout == "1\n"
    assert _leftover_groups() == []


def test_check_says_which_limits_hold(mode: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["check", "--run-limits", mode]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == [
        "sandbox",
        "memory",
        "kernel",
        "keyring",
        "processes",
        "cpu",
        "cpuset",
        "seccomp",
        "network",
        "root",
        "files",
    ]
    by_name = dict(zip(names, lines, strict=True))
    assert "[MISSING]" not in "\n".join(lines)
    if mode == "cgroup":
        assert by_name["memory"].split()[1:3] == ["per", "run"]
        assert "shared memory" in by_name["memory"] and "status memory" in by_name["memory"]
        assert "charged to the run" in by_name["kernel"] and "unix" in by_name["kernel"]
        assert "pinning pipe pages past unmapping: stopped, status memory" in by_name["memory"]
    else:
        assert "refused by seccomp" in by_name["memory"] and "memfd EPERM" in by_name["memory"]
        assert "held unix 0 (EPERM), tcp 0 (EPERM) of 64 MiB" in by_name["kernel"]
        assert "pipe_size EPERM, splice EPERM, sendfile EPERM, tee EPERM" in by_name["kernel"]
        assert "io_uring EPERM, io_setup EPERM" in by_name["kernel"]
        assert "held 0 MiB, vmsplice EPERM/EPERM" in by_name["memory"]
    assert by_name["seccomp"].split()[1] == "on"
    assert "keyctl EPERM" in by_name["keyring"]
    assert "interfaces lo," in by_name["network"] and "EROFS" in by_name["root"]
    if os.geteuid() == 0:
        assert "stopped at 4094, ENOSPC" in by_name["files"]


def test_check_without_run_limits_names_the_holes(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["check", "--run-limits", "none"]) == 1
    out = capsys.readouterr().out
    missing = [line.split()[0] for line in out.splitlines() if line.endswith("[MISSING]")]
    assert missing == ["memory", "kernel", "keyring", "cpu", "cpuset"]
    assert "memfd allowed" in out and "socketpair allowed" in out and "keyctl allowed" in out
    assert "vmsplice held/held" in out
