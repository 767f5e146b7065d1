"""Hostile programs against the real sandbox (bubblewrap + rlimits), on CPU.

Each test runs a program that tries to escape or exhaust something and checks
both the sandbox's verdict and, from the host, that nothing was harmed: the
listener saw no connection, host files are unchanged, no process survives.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tracemalloc
import uuid
from pathlib import Path

import pytest

from rlpost.rewards.sandbox import (
    SandboxConfig,
    SandboxPool,
    SandboxUnavailable,
    check_available,
    cli,
    parse_outcomes,
    run_code,
    run_python_tests,
)
from tests.conftest import pids_with

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
SHORT = SandboxConfig(timeout_s=2.0)


@pytest.fixture(autouse=True, scope="module")
def _sandbox_available() -> None:
    try:
        check_available()
    except SandboxUnavailable as exc:
        # CI sets RLPOST_REQUIRE_SANDBOX=1 so a broken sandbox fails instead of skipping.
        if os.environ.get("RLPOST_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox unavailable: {exc}")
        pytest.skip(f"sandbox unavailable: {exc}")


def _marker() -> str:
    return f"rlpost-sandbox-test-{uuid.uuid4().hex}"


def test_normal_program_is_ok_with_its_stdout() -> None:
    code = "import sys\nprint(sum(range(10)))\nprint(sys.stdin.read().upper())\n"
    result = run_code(code, stdin="abc")
    assert (result.status, result.exit_code) == ("ok", 0)
    assert result.stdout == "45\nABC\n"


def test_syntax_error_is_error() -> None:
    result = run_code("def f(:\n")
    assert (result.status, result.exit_code) == ("error", 1)
    assert "SyntaxError" in result.stderr


def test_runs_unprivileged_on_one_cpu_with_rlimits() -> None:
    code = (
        "import json, os, resource\n"
        "print(json.dumps([os.getuid(), len(os.sched_getaffinity(0)),\n"
        "    resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_AS)[0],\n"
        "    resource.getrlimit(resource.RLIMIT_CORE)[0], sorted(os.listdir('/')),\n"
        "    resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],\n"
        "    resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0],\n"
        "    resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]]))\n"
    )
    result = run_code(code)
    uid, cpus, nproc, address_space, core, top, *kernel = json.loads(result.stdout)
    assert (uid, cpus, nproc, address_space, core) == (65534, 1, 64, 2048 << 20, 0)
    assert kernel == [0, 0, 256]  # locked memory, POSIX queues, queued signals
    assert "root" not in top and "home" not in top and "work" not in top


def test_network_is_unreachable_and_listener_sees_nothing() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            "print(open('/proc/net/dev').read().split())\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('CONNECTED')\n"
            "except OSError as exc:\n"
            "    print('refused', type(exc).__name__)\n"
        )
        result = run_code(code)
        listener.settimeout(0.3)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.status == "ok"
    assert "CONNECTED" not in result.stdout and "refused" in result.stdout
    # Only the namespace's own loopback: one interface line after the two header lines.
    assert result.stdout.count(":") == 1 and "'lo:'" in result.stdout


def test_writes_outside_private_tmp_fail_and_host_is_unchanged(tmp_path: Path) -> None:
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = [f"/etc/{name}", f"/usr/{name}", f"/{name}", str(REPO / name), str(tmp_path / name)]
    existing = [p for p in ("/etc/hostname", "/usr/lib/os-release") if Path(p).is_file()]
    before = {path: Path(path).read_bytes() for path in existing}
    code = (
        "import os\n"
        f"for path in {targets + existing!r}:\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "        with open(path, 'a') as f:\n"
        "            f.write('pwned')\n"
        "        print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', path, exc.errno)\n"
        "open('/tmp/ok.txt', 'w').write('fine')\n"
        "print(open('/tmp/ok.txt').read())\n"
    )
    result = run_code(code)
    assert result.status == "ok"
    # Writing into the private /tmp works, and it is not the host's /tmp.
    assert result.stdout.endswith("fine\n") and not Path("/tmp/ok.txt").exists()
    for path in targets:
        assert not Path(path).exists(), path
    assert {path: Path(path).read_bytes() for path in existing} == before
    # Only paths under the private /tmp could be created inside (tmp_path is under
    # /tmp, and so is the repository when it is checked out there); none reached the host.
    wrote = [line for line in result.stdout.splitlines() if line.startswith("WROTE")]
    assert wrote == [f"WROTE {t}" for t in targets if t.startswith("/tmp/")]
    assert f"WROTE {tmp_path / name}" in wrote


def test_parent_environment_and_root_are_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLPOST_SANDBOX_TEST_SECRET", secret)
    code = (
        "import glob, os\n"
        "print(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(path, exc.errno)\n"
        "for path in ['/root', '/root/.bashrc', '/root/.pyenv', "
        f"{str(REPO)!r}, '/home']:\n"
        "    try:\n"
        "        print('LISTED', path, os.listdir(path) if os.path.isdir(path) else open(path).read())\n"
        "    except OSError as exc:\n"
        "        print('absent', path, exc.errno)\n"
    )
    result = run_code(code)
    assert result.status == "ok"
    assert secret not in result.stdout + result.stderr
    assert "LISTED" not in result.stdout
    assert str(REPO) not in result.stdout.replace(f"absent {REPO}", "")


def test_fork_bomb_is_contained_and_leaves_no_process() -> None:
    marker = _marker()
    code = (
        "import os, sys\n"
        f"if {marker!r} not in sys.argv:\n"
        f"    os.execv(sys.executable, [sys.executable, '-S', 'main.py', {marker!r}])\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        continue\n"
    )
    result = run_code(code, config=SHORT)
    assert result.status in ("timeout", "killed", "error")
    assert result.wall_seconds < SHORT.timeout_s + 3
    assert pids_with(marker) == []
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    assert run_code("print('alive')").stdout == "alive\n"


def test_process_cap_stops_forking() -> None:
    code = (
        "import os, time\n"
        "count = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(10)\n"
        "            os._exit(0)\n"
        "        count += 1\n"
        "except OSError:\n"
        "    print(count)\n"
    )
    result = run_code(code, config=SHORT)
    assert result.status == "ok"
    assert 0 < int(result.stdout) < 64
    assert result.wall_seconds < SHORT.timeout_s  # the sleeping children died with main


def test_memory_beyond_the_limit_is_memory() -> None:
    grow = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n"
    small = run_code(grow, config=SandboxConfig(timeout_s=5.0, memory_mb=256))
    assert small.status == "memory"
    huge = run_code("x = bytearray(8 << 30)\n")  # default 2 GB address-space limit
    assert huge.status == "memory"
    assert "MemoryError" in huge.stderr


def test_infinite_loop_times_out_near_the_limit() -> None:
    config = SandboxConfig(timeout_s=1.5)
    result = run_code("while True:\n    pass\n", config=config)
    assert (result.status, result.exit_code) == ("timeout", None)
    assert config.timeout_s <= result.wall_seconds < config.timeout_s + 1.5


def test_sleeping_child_left_behind_is_killed() -> None:
    marker = _marker()
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-S', '-c', 'import time; time.sleep(60)', "
        f"{marker!r}], start_new_session=True)\n"
        "print(child.pid)\n"
    )
    result = run_code(code)
    assert result.status == "ok" and result.stdout.strip().isdigit()
    assert result.wall_seconds < 5
    assert pids_with(marker) == []


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_printing_gigabytes_hits_output_limit_fast(stream: str) -> None:
    code = f"import sys\nchunk = 'x' * (1 << 20)\nwhile True:\n    sys.{stream}.write(chunk)\n"
    tracemalloc.start()
    try:
        result = run_code(code)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (result.status, result.exit_code) == ("output_limit", None)
    assert len(getattr(result, stream)) == 1 << 20
    assert result.wall_seconds < 3
    assert peak < 16 << 20  # the host kept about one capped buffer, not gigabytes


def test_pool_returns_results_in_input_order() -> None:
    codes = [f"import time\ntime.sleep({0.3 - 0.1 * i})\nprint({i})\n" for i in range(3)]
    codes.append("raise SystemExit(3)\n")
    with SandboxPool(max_workers=4) as pool:
        results = pool.map(codes)
    assert [r.stdout for r in results[:3]] == ["0\n", "1\n", "2\n"]
    assert (results[3].status, results[3].exit_code) == ("error", 3)


ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]


def test_test_runner_pass_fraction() -> None:
    fraction, result = run_python_tests(ADD, ADD_TESTS)
    assert result.status == "ok"
    assert fraction == pytest.approx(2 / 3)
    assert "AssertionError" in result.stderr


def test_test_runner_ignores_forged_pass_markers() -> None:
    forger = (
        "import os, sys\n"
        "def add(a, b):\n"
        "    return -1\n"
        "for i in range(10):\n"
        "    for line in (f'{i} pass', f'pass {i}', f'x {i} pass'):\n"
        "        print(line)\n"
        "        sys.stderr.write(line + '\\n')\n"
        "harness = os.getppid()\n"
        "for path in (f'/proc/{harness}/mem', f'/proc/{harness}/fd/1', f'/proc/{harness}/environ',\n"
        "             '/proc/1/fd/1'):\n"
        "    try:\n"
        "        open(path, 'rb').read(16)\n"
        "        print('OPENED', path, file=sys.stderr)\n"
        "    except OSError as exc:\n"
        "        print('denied', path, exc.errno, file=sys.stderr)\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    fraction, result = run_python_tests(forger, ADD_TESTS)
    assert fraction == 0.0
    assert "OPENED" not in result.stderr
    assert all(len(line.split(" ")) == 3 for line in result.stdout.splitlines())


@pytest.mark.parametrize(
    "candidate",
    [
        "import sys\nsys.exit(0)\n",
        "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\n",
    ],
)
def test_test_runner_counts_early_exit_and_patched_exec_as_failures(candidate: str) -> None:
    fraction, _ = run_python_tests(candidate, ADD_TESTS)
    assert fraction == 0.0


def test_test_runner_bounds_a_looping_test() -> None:
    tests = ["assert add(1, 2) == 3", "while True:\n    pass", "assert add(2, 3) == 5"]
    fraction, result = run_python_tests(ADD, tests, test_timeout_s=1.0)
    assert fraction == pytest.approx(2 / 3)
    nonces = {line.split(" ")[0] for line in result.stdout.splitlines()}
    assert len(nonces) == 1
    assert parse_outcomes(result.stdout, nonces.pop(), 3) == ["pass", "timeout", "pass"]


def test_cli_runs_a_file_and_exits_by_status(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = tmp_path / "good.py"
    good.write_text("print(input()[::-1])\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("abc\n")
    assert cli.main(["run", str(good), "--stdin", str(stdin), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["status"], payload["exit_code"], payload["stdout"]) == ("ok", 0, "cba\n")
    bad = tmp_path / "bad.py"
    bad.write_text("while True:\n    pass\n")
    assert cli.main(["run", str(bad), "--timeout", "0.5"]) == 1
    assert capsys.readouterr().out.splitlines()[:2] == ["status:    timeout", "exit code: None"]


@pytest.mark.parametrize(
    "cheat",
    [
        "import os, sys\nos.write(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 3, b'pass')\n",
        "import os\nfor f in os.listdir('/proc/self/fd'):\n    try:\n        os.write(int(f), b'pass')\n"
        "    except OSError:\n        pass\n",
        "import os\nfor f in range(3, 5000):\n    try:\n        os.write(f, b'pass' * 8)\n"
        "    except OSError:\n        pass\n",
        "try:\n    raise ValueError\nexcept ValueError as e:\n    f = e.__traceback__.tb_frame.f_back\n"
        "    __import__('os').write(f.f_locals['fd'], f.f_locals['token'])\n",
        "import gc\nfor o in gc.get_objects():\n    pass\n",
    ],
)
def test_a_candidate_cannot_report_a_pass_for_a_failing_test(cheat: str) -> None:
    """Writing to the report pipe (found from argv, /proc/self/fd or by trying every
    descriptor) or reading the child's secrets through frames or the object graph, then
    exiting 0 before the test runs: the failing tests stay failures."""
    fraction, _ = run_python_tests(ADD + cheat + "__import__('os')._exit(0)\n", ADD_TESTS)
    assert fraction == 0.0
