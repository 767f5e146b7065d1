"""Hostile programs against memory the kernel holds outside any address space, and
against the supervisor's keyring, in the real sandbox, on CPU.

Each test runs with the run's own cgroup (``run_limits="cgroup"``, skipped where
the host gives none) and with the no-cgroup path forced (``run_limits="seccomp"``).
Socket buffers are measured by the program itself: what it managed to queue is
a lower bound of what the kernel held for it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.rewards.sandbox import SandboxConfig, cli, seccomp
from rlpost.rewards.sandbox import cgroup as cgroups
from rlpost.rewards.sandbox.check import SOCKET_BUFFERS
from rlpost.rewards.sandbox.command import (
    SANDBOX_UID,
    Interpreter,
    build_command,
    caps_files,
    find_tools,
)
from rlpost.rewards.sandbox.runner import run_code
from tests.integration.test_sandbox_security import _sandbox_available  # noqa: F401 (autouse)

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
LIMIT_MB = 256


@pytest.fixture(params=["cgroup", "seccomp"])
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "cgroup":
        host = cgroups.detect()
        if host.get("memory") is None or host.get("pids") is None:
            reasons = "; ".join(f"{n}: {r}" for n, r in host.missing)
            pytest.skip(f"no per-run cgroup on this host ({reasons})")
    return request.param


def _cli_json(capsys: pytest.CaptureFixture, tmp_path: Path, stdin: str, *options: str) -> dict:
    """``rlpost sandbox run main.py --json OPTIONS`` on SOCKET_BUFFERS; its result."""
    program, text = tmp_path / "main.py", tmp_path / "stdin.txt"
    program.write_text(SOCKET_BUFFERS)
    text.write_text(stdin)
    cli.main(["run", str(program), "--stdin", str(text), "--json", *options])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_socket_buffers_stay_under_the_memory_limit(
    mode: str, kind: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    limits = ("--run-limits", mode, "--memory", str(LIMIT_MB), "--timeout", "20")
    result = _cli_json(capsys, tmp_path, kind, *limits)
    held = [int(line.split()[1]) for line in result["stdout"].splitlines() if "held" in line]
    assert max(held, default=0) < LIMIT_MB, result["stdout"][-300:]
    if mode == "seccomp" or kind == "tcp":
        # Refused before a byte is queued (a cgroup v2 group would charge TCP instead).
        refused = "stopped EPERM" in result["stdout"]
        assert refused or result["status"] == "memory", result
    else:
        assert result["status"] == "memory"


KERNEL_MEMORY = r"""
import ctypes, errno, fcntl, json, os, sys
nr = json.loads(sys.stdin.read())
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
seen = {}
def call(name, *args):
    got = libc.syscall(ctypes.c_long(nr[name]), *args)
    seen[name] = "allowed" if got >= 0 else errno.errorcode[ctypes.get_errno()]
r, w = os.pipe()
try:
    fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
    seen["F_SETPIPE_SZ"] = "allowed"
except OSError as exc:
    seen["F_SETPIPE_SZ"] = errno.errorcode[exc.errno]
call("io_uring_setup", ctypes.c_long(4096), ctypes.create_string_buffer(120))
call("inotify_init1", ctypes.c_long(0))
call("mq_open", b"q", ctypes.c_long(os.O_CREAT | os.O_RDWR), ctypes.c_long(0o600), None)
call("bpf", ctypes.c_long(0), ctypes.create_string_buffer(128), ctypes.c_long(128))
call("userfaultfd", ctypes.c_long(0))
print(json.dumps(seen))
"""


def test_other_kernel_memory_is_refused_without_a_cgroup() -> None:
    names = ["io_uring_setup", "inotify_init1", "mq_open", "bpf", "userfaultfd"]
    numbers = {name: seccomp.ARCHES[platform.machine()].numbers[name] for name in names}
    result = run_code(KERNEL_MEMORY, stdin=json.dumps(numbers), config=_seccomp())
    assert result.status == "ok", result.stderr
    assert json.loads(result.stdout) == dict.fromkeys(["F_SETPIPE_SZ", *names], "EPERM")


MANY_FILES = r"""
import errno, os, sys
made, cap, stop = 0, int(sys.stdin.read()), "none"
try:
    while made < cap + 500:
        path = ("/tmp", "/dev/shm")[made % 2]
        os.mkdir(f"{path}/d{made}") if made % 3 == 0 else open(f"{path}/f{made}", "w").close()
        made += 1
except OSError as exc:
    stop = errno.errorcode[exc.errno]
print(made, stop)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the file cap needs the root's mount stage")
def test_files_on_the_private_tmpfs_are_capped(mode: str) -> None:
    config = SandboxConfig(run_limits=mode, timeout_s=20.0, max_tmp_files=300)
    result = run_code(MANY_FILES, stdin="300", config=config)
    assert result.status == "ok", result.stderr
    made, stop = result.stdout.split()
    # Files and directories alternate between /tmp and /dev/shm, 300 inodes each.
    assert stop == "ENOSPC" and 500 <= int(made) <= 600, result.stdout


def test_files_are_capped_when_the_supervisor_is_not_root(monkeypatch, tmp_path: Path) -> None:
    """The command a uid-65534 supervisor builds, run as uid 65534: the user
    namespace mount stage caps the files as root's does."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(python):
        pytest.skip("switching to uid 65534 needs root, setpriv and a /usr/bin/python3")
    tools = find_tools()
    monkeypatch.setattr(os, "geteuid", lambda: SANDBOX_UID)
    if not caps_files(tools):
        pytest.skip("this kernel refuses unprivileged user namespaces: no file cap")
    program, (info_r, info_w) = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR), os.pipe()
    os.write(program, MANY_FILES.encode())
    os.lseek(program, 0, os.SEEK_SET)
    config = SandboxConfig(max_tmp_files=300)
    files = [(program, "main.py")]
    argv = build_command(
        tools,
        Interpreter(None, python),
        config,
        cpu=0,
        files=files,
        info_fd=info_w,
        argv=["-S", "/tmp/main.py"],
    )
    assert "--map-root-user" in argv and "--tmpfs" not in argv
    uid = str(SANDBOX_UID)
    drop = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--"]
    done = subprocess.run(
        drop + argv,
        input="300",
        pass_fds=(program, info_w),
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.close(info_r), os.close(info_w), os.close(program)
    assert done.returncode == 0, done.stderr
    made, stop = done.stdout.split()
    assert stop == "ENOSPC" and 500 <= int(made) <= 600, done.stdout


def _seccomp() -> SandboxConfig:
    return SandboxConfig(run_limits="seccomp", timeout_s=20.0, memory_mb=LIMIT_MB)


def test_pipes_and_process_pools_still_work_without_a_cgroup() -> None:
    code = (
        "import multiprocessing, subprocess, sys\n"
        "with multiprocessing.Pool(2) as pool:\n"
        "    print(sum(pool.map(abs, range(-5, 5))))\n"
        "out = subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True)\n"
        "print(out.stdout.decode().strip())\n"
    )
    result = run_code(code, config=_seccomp())
    assert (result.status, result.stdout) == ("ok", "25\n7\n"), result.stderr


# Runs in its own process: joins a fresh session keyring, puts a secret in it, then
# lets sandboxed code search, read and clear that keyring.
KEYRING_HOST = r"""
import ctypes, json, sys
from rlpost.rewards.sandbox import SandboxConfig, run_code
mode, add_key, keyctl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
assert libc.syscall(L(keyctl), L(1), None) > 0  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
key = libc.syscall(L(add_key), b"user", b"rlpost-secret", b"hunter2", L(7), L(-3))
assert key > 0, ctypes.get_errno()
code = '''
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L, nr = ctypes.c_long, ctypes.c_long(int(sys.stdin.read()))
buf = ctypes.create_string_buffer(64)
found = libc.syscall(nr, L(10), L(-3), b"user", b"rlpost-secret", L(0))  # KEYCTL_SEARCH
got = libc.syscall(nr, L(11), L(found), buf, L(64)) if found > 0 else -1  # KEYCTL_READ
print("found", found, "read", buf.raw[: max(got, 0)].decode() or "-", flush=True)
print("cleared", libc.syscall(nr, L(7), L(-3)))  # KEYCTL_CLEAR
'''
result = run_code(code, stdin=str(keyctl), config=SandboxConfig(run_limits=mode))
buf = ctypes.create_string_buffer(64)
got = libc.syscall(L(keyctl), L(11), L(key), buf, L(64))
print(json.dumps([result.status, result.stdout, buf.raw[: max(got, 0)].decode()]))
"""


def test_sandboxed_code_cannot_reach_the_supervisors_keyring(mode: str) -> None:
    numbers = seccomp.ARCHES[platform.machine()].numbers
    argv = [sys.executable, "-c", KEYRING_HOST, mode]
    argv += [str(numbers["add_key"]), str(numbers["keyctl"])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, stdout, host_reads = json.loads(proc.stdout.splitlines()[-1])
    assert status == "ok"
    assert stdout == "found -1 read -\ncleared -1\n"
    assert host_reads == "hunter2"  # still in the supervisor's keyring, untouched
