"""Hostile programs against memory the kernel holds outside any address space, and
against the supervisor's keyring, in the real sandbox, on CPU.

Each test runs with the run's own cgroup (``run_limits="cgroup"``, skipped where
the host gives none) and with the no-cgroup path forced (``run_limits="seccomp"``).
Socket buffers are measured by the program itself: what it managed to queue is
a lower bound of what the kernel held for it.
"""

from __future__ import annotations

import functools
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
from rlpost.rewards.sandbox.check import PIN_PAGES, SOCKET_BUFFERS
from rlpost.rewards.sandbox.command import (
    SANDBOX_UID,
    Interpreter,
    build_command,
    caps_files,
    find_tools,
)
from rlpost.rewards.sandbox.plan import make_plan
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
call("io_setup", ctypes.c_long(1), ctypes.byref(ctypes.c_ulong(0)))
# Calls that hand a pipe pages by reference, which outlive their unmapping or truncation.
page = ctypes.create_string_buffer(4096)
call("vmsplice", ctypes.c_long(w), ctypes.byref((ctypes.c_void_p * 2)(ctypes.addressof(page), 4096)),
     ctypes.c_long(1), ctypes.c_long(0))
with open("/tmp/file", "wb+") as f:
    f.write(page.raw), f.flush()
    call("splice", ctypes.c_long(f.fileno()), None, ctypes.c_long(w), None, ctypes.c_long(4096),
         ctypes.c_long(0))
    call("sendfile", ctypes.c_long(w), ctypes.c_long(f.fileno()), None, ctypes.c_long(4096))
os.write(w, b"x")
call("tee", ctypes.c_long(r), ctypes.c_long(os.pipe()[1]), ctypes.c_long(1), ctypes.c_long(2))
print(json.dumps(seen))
"""


def test_other_kernel_memory_is_refused_without_a_cgroup() -> None:
    names = ["io_uring_setup", "inotify_init1", "mq_open", "bpf", "userfaultfd", "io_setup"]
    names += ["vmsplice", "splice", "sendfile", "tee"]
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
    done = _as_nobody(monkeypatch, tmp_path, MANY_FILES, "300", SandboxConfig(max_tmp_files=300))
    assert done.returncode == 0, done.stderr
    made, stop = done.stdout.split()
    assert stop == "ENOSPC" and 500 <= int(made) <= 600, done.stdout


def _as_nobody(
    monkeypatch, tmp_path: Path, code: str, stdin: str, config: SandboxConfig, prefix=(), **seccomp
) -> subprocess.CompletedProcess:
    """``code`` through the command a uid-65534 supervisor builds (its user namespace mount
    stage; ``seccomp=program`` for its filter), run as uid 65534 after ``prefix``."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(python):
        pytest.skip("switching to uid 65534 needs root, setpriv and a /usr/bin/python3")
    tools = find_tools()
    with monkeypatch.context() as patch:
        patch.setattr(os, "geteuid", lambda: SANDBOX_UID)
        if not caps_files(tools):
            pytest.skip("this kernel refuses unprivileged user namespaces: no file cap")
        program, (info_r, info_w) = os.open(tmp_path, os.O_TMPFILE | os.O_RDWR), os.pipe()
        os.write(program, code.encode())
        os.lseek(program, 0, os.SEEK_SET)
        fds = [program, info_w]
        if "seccomp" in seccomp:
            fds.append(os.memfd_create("seccomp"))
            os.write(fds[-1], seccomp["seccomp"])
            os.lseek(fds[-1], 0, os.SEEK_SET)
        argv = build_command(
            tools,
            Interpreter(None, python),
            config,
            cpu=0,
            files=[(program, "main.py")],
            info_fd=info_w,
            argv=["-S", "/tmp/main.py"],
            seccomp_fd=fds[2] if len(fds) > 2 else None,
        )
    assert "--map-root-user" in argv and "--tmpfs" not in argv
    uid = str(SANDBOX_UID)
    drop = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--"]
    try:
        return subprocess.run(
            [*prefix, *drop, *argv],
            input=stdin,
            pass_fds=fds,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for fd in [info_r, *fds]:
            os.close(fd)


# Each of PIN_PROCESSES processes tries to pin four times what it may hold.
PIN_MB, PIN_LIMIT_MB = 256, 64
# A run of PIN_PAGES through the real runner, in a process of its own: [status, stdout].
PIN_RUN = r"""
import json, sys
from rlpost.rewards.sandbox import SandboxConfig, run_code
from rlpost.rewards.sandbox.check import PIN_PAGES
config = SandboxConfig(run_limits=sys.argv[1], memory_mb=int(sys.argv[2]), timeout_s=60)
result = run_code(PIN_PAGES, stdin=sys.argv[3], config=config)
print(json.dumps([result.status, result.stdout]))
"""


def _measured(run) -> tuple[str, str, int]:
    """``run(prefix)`` (a run of PIN_PAGES whose command starts with ``prefix``) inside a
    memory cgroup of its own without a limit: its status, stdout and peak memory in MiB."""
    memory = cgroups.detect().get("memory")
    if memory is None:
        pytest.skip(f"no memory cgroup to measure a run in ({cgroups.detect().reason('memory')})")
    group = cgroups.RunGroup.create({"memory": memory}, memory_bytes=1 << 40, max_pids=0, cpu=0)
    try:
        done = run([*group.join_argv(shutil.which("sh") or "/bin/sh")])
        controller, path = group.dirs["memory"]
        peak = "memory.peak" if controller.version == 2 else "memory.max_usage_in_bytes"
        return *done, int(Path(path, peak).read_text()) >> 20
    finally:
        group.close()


@pytest.mark.parametrize("path", ["cgroup", "seccomp", "not root"])
def test_pipes_cannot_hold_pages_past_the_memory_bound(
    path: str, monkeypatch, tmp_path: Path
) -> None:
    """vmsplice of transparent huge pages into pipes, then unmapping them, by two processes
    at PIN_LIMIT_MB: what the run holds, as its own memory cgroup measured it, stays
    within the bound, and without a memory cgroup the calls that pin are refused."""
    if path == "cgroup" and cgroups.detect().get("memory") is None:
        pytest.skip("no per-run memory cgroup on this host")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The non-root supervisor's plan where no cgroup is writable.
    nobody = make_plan("auto", cgroups.CgroupHost((), ()), seccomp_supported=True)

    def run(mb: int, prefix: list[str]) -> tuple[str, str]:
        ask = json.dumps({"mb": mb, "processes": 2})
        if path == "not root":
            config = SandboxConfig(memory_mb=PIN_LIMIT_MB, timeout_s=60)
            program = nobody.seccomp_program
            done = _as_nobody(
                monkeypatch, tmp_path, PIN_PAGES, ask, config, prefix, seccomp=program
            )
            return ("ok" if done.returncode == 0 else done.stderr), done.stdout
        argv = [sys.executable, "-c", PIN_RUN, path, str(PIN_LIMIT_MB), ask]
        done = subprocess.run(
            [*prefix, *argv], capture_output=True, text=True, env=env, timeout=180
        )
        status, stdout = json.loads(done.stdout)
        return status, stdout

    *_, baseline = _measured(functools.partial(run, 0))
    status, stdout, peak = _measured(functools.partial(run, PIN_MB))
    bound = PIN_LIMIT_MB if path == "cgroup" else 2 * PIN_LIMIT_MB
    assert peak - baseline <= bound, (status, stdout, peak, baseline)
    if path == "cgroup":
        assert status == "memory" or json.loads(stdout)["held_mb"] <= bound, stdout
    else:
        assert status == "ok", status
        assert json.loads(stdout) == {"held_mb": 0, "vmsplice": ["EPERM", "EPERM"]}


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
