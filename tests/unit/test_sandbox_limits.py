"""Sandbox pieces that need no sandbox: config validation, result classification,
marker parsing, the command line, failing closed, and the CLI's argument errors.
Runs on CPU in well under a second; nothing here starts bubblewrap.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

import pytest

from rlpost.rewards.sandbox import (
    SandboxConfig,
    SandboxPool,
    SandboxResult,
    SandboxUnavailable,
    check_available,
    cli,
    command,
    parse_outcomes,
    run_code,
    run_python_tests,
    runner,
)
from rlpost.rewards.sandbox.command import Interpreter, Tools, _user_mounts, build_command
from rlpost.rewards.sandbox.limits import classify


def test_defaults_match_the_documented_limits() -> None:
    config = SandboxConfig()
    assert (config.timeout_s, config.memory_mb, config.max_processes) == (5.0, 2048, 64)
    assert config.max_output_bytes == 1 << 20
    assert config.cpu_seconds == 6


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SandboxConfig().timeout_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", float("nan")),
        ("timeout_s", float("inf")),
        ("memory_mb", 63),
        ("max_processes", 0),
        ("max_output_bytes", 0),
        ("max_file_mb", 0),
        ("tmpfs_mb", 0),
        ("max_tmp_files", 15),
        ("max_open_files", 8),
        ("cpu", -1),
        ("max_processes", True),
        ("run_limits", "cgroups"),
    ],
)
def test_bad_config_values_are_one_line_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        SandboxConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"sandbox {field}=") and "\n" not in message


@pytest.mark.parametrize(
    ("returncode", "stderr", "stopped", "expected"),
    [
        (0, b"", None, ("ok", 0)),
        (1, b"Traceback...\nZeroDivisionError: division by zero\n", None, ("error", 1)),
        (1, b"Traceback...\nMemoryError\n", None, ("memory", 1)),
        (128 + signal.SIGSEGV, b"", None, ("killed", -signal.SIGSEGV)),
        (128 + signal.SIGKILL, b"out of memory", None, ("memory", -signal.SIGKILL)),
        (128 + signal.SIGXCPU, b"", None, ("timeout", -signal.SIGXCPU)),
        (-signal.SIGKILL, b"", None, ("killed", -signal.SIGKILL)),
        (None, b"", None, ("killed", None)),
        (137, b"", "timeout", ("timeout", None)),
        (0, b"", "output_limit", ("output_limit", None)),
    ],
)
def test_classify(returncode, stderr, stopped, expected) -> None:
    assert classify(returncode, stderr, stopped) == expected


@pytest.mark.parametrize(
    ("returncode", "stopped", "expected"),
    [
        (128 + signal.SIGKILL, None, ("memory", -signal.SIGKILL)),  # the program was OOM-killed
        (-signal.SIGKILL, None, ("memory", -signal.SIGKILL)),  # a bwrap monitor was
        (1, None, ("memory", 1)),  # a child was killed and the parent failed
        (0, None, ("ok", 0)),  # a child was killed, the program coped
        (137, "timeout", ("timeout", None)),
    ],
)
def test_an_oom_kill_in_the_run_cgroup_is_a_memory_verdict(returncode, stopped, expected) -> None:
    assert classify(returncode, b"", stopped, oom_kills=1) == expected


def test_memory_hint_is_read_only_from_the_tail_of_stderr() -> None:
    stderr = b"MemoryError mentioned early\n" + b"x" * 10_000 + b"\nValueError: bad\n"
    assert classify(1, stderr, None) == ("error", 1)


def test_result_ok_property() -> None:
    assert SandboxResult("ok", 0, "", "", 0.1).ok
    assert not SandboxResult("timeout", None, "", "", 5.0).ok


NONCE = "a" * 32


def test_parse_outcomes_ignores_forged_duplicate_and_out_of_range_lines() -> None:
    stdout = "\n".join(
        [
            "0 pass",  # no nonce
            f"{'b' * 32} 1 pass",  # wrong nonce
            f"{NONCE} 0 fail",
            f"{NONCE} 0 pass",  # repeated index: the first line wins
            f"{NONCE} 7 pass",  # out of range
            f"{NONCE} 2 pass extra",  # malformed
            f"prefix{NONCE} 2 pass",
            f"{NONCE} 1 timeout",
        ]
    )
    assert parse_outcomes(stdout, NONCE, 3) == ["fail", "timeout", "missing"]


def test_parse_outcomes_counts_passes() -> None:
    stdout = f"{NONCE} 0 pass\n{NONCE} 1 fail\n{NONCE} 2 pass\n"
    assert parse_outcomes(stdout, NONCE, 3).count("pass") == 2


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x.py", "a/../b.py", "a//b", "./a.py"])
def test_bad_file_names_are_refused_before_anything_runs(name: str) -> None:
    with pytest.raises(ValueError, match="sandbox file name"):
        run_code("print(1)", files={name: "x"})


def test_main_py_cannot_be_overwritten_by_files() -> None:
    with pytest.raises(ValueError, match="reserved"):
        run_code("print(1)", files={"main.py": "print(2)"})


def test_bad_arguments_of_helpers_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one test"):
        run_python_tests("x = 1", [])
    with pytest.raises(ValueError, match="test_timeout_s"):
        run_python_tests("x = 1", ["assert x"], test_timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        SandboxPool(0)


def _fake_tool(directory: Path, name: str, help_text: str) -> None:
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --help ]; then echo "{help_text}"; exit 0; fi\n'
        "echo 'bwrap: Creating new namespace failed: Operation not permitted' >&2\n"
        "exit 1\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_missing_bwrap_fails_closed_with_the_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(runner.subprocess, "Popen", _never_called)
    with pytest.raises(SandboxUnavailable) as info:
        run_code("print(1)")
    message = str(info.value)
    assert "apt-get install -y bubblewrap" in message and "\n" not in message


def test_old_bwrap_without_required_options_is_refused(monkeypatch, tmp_path) -> None:
    for name in ("bwrap", "prlimit", "taskset", "setpriv", "unshare", "mount", "sh"):
        _fake_tool(tmp_path, name, "--unshare-all --ro-bind")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"lacks --disable-userns, --size; .*>= 0\.8\.0"):
        check_available()


def test_bwrap_that_cannot_build_namespaces_is_refused(monkeypatch, tmp_path) -> None:
    for name in ("bwrap", "prlimit", "taskset", "setpriv", "unshare", "mount", "sh"):
        _fake_tool(tmp_path, name, "--disable-userns --size")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable) as info:
        check_available()
    message = str(info.value)
    assert "Operation not permitted" in message and "user.max_user_namespaces" in message
    assert "\n" not in message


def _never_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("a program was started although the sandbox is unavailable")


TOOLS = Tools(
    bwrap="/usr/bin/bwrap",
    prlimit="/usr/bin/prlimit",
    taskset="/usr/bin/taskset",
    setpriv="/usr/bin/setpriv",
    sh="/bin/sh",
    unshare="/usr/bin/unshare",
    mount="/usr/bin/mount",
)


def _command(monkeypatch, euid: int, interpreter: Interpreter, tools: Tools = TOOLS) -> list[str]:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    files = [(7, "main.py")]
    config = SandboxConfig()
    return build_command(
        tools, interpreter, config, cpu=3, files=files, info_fd=5, argv=["-S", "main.py"]
    )


def _pairs(argv: list[str], option: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == option]


def test_command_isolates_and_limits(monkeypatch) -> None:
    no_unshare = dataclasses.replace(TOOLS, unshare=None)
    argv = _command(monkeypatch, 1000, Interpreter(None, "/usr/bin/python3.11"), no_unshare)
    # The pin is set outside bwrap: inside, seccomp may refuse sched_setaffinity.
    assert argv[:4] == ["/usr/bin/taskset", "--cpu-list", "3", "/usr/bin/bwrap"]
    assert "/usr/bin/setpriv" not in argv and "--seccomp" not in argv
    isolation = {"--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"}
    assert isolation | {"--new-session", "--clearenv", "--info-fd"} <= set(argv)
    assert ("/usr", "/usr") in _pairs(argv, "--ro-bind")
    assert [argv[i - 2 : i + 2] for i, arg in enumerate(argv) if arg == "--tmpfs"] == [
        ["--size", str(64 << 20), "--tmpfs", "/dev/shm"],
        ["--size", str(64 << 20), "--tmpfs", "/tmp"],
    ]
    assert ("7", "/tmp/main.py") in _pairs(argv, "--file")
    # The root is made read-only last, after every mount point and file exists.
    assert [dest for dest, _ in _pairs(argv, "--remount-ro")] == ["/dev", "/"]
    assert argv.index("--file") < len(argv) - argv[::-1].index("--remount-ro")
    tail = argv[argv.index("--", argv.index("--clearenv")) :]
    assert tail[1] == "/usr/bin/prlimit"
    assert {"--as=2147483648", "--cpu=6:7", "--nproc=64", "--core=0"} <= set(tail)
    assert tail[-3:] == ["/usr/bin/python3.11", "-S", "main.py"]


def test_command_as_root_drops_to_nobody_and_stages_a_private_prefix(monkeypatch, tmp_path) -> None:
    prefix = tmp_path / "private" / "python"
    prefix.mkdir(parents=True)
    (tmp_path / "private").chmod(0o700)
    argv = _command(monkeypatch, 0, Interpreter(str(prefix), "/opt/python/bin/python3.11"))
    setpriv = argv.index("/usr/bin/setpriv")
    assert argv[setpriv + 1 : setpriv + 5] == ["--reuid", "65534", "--regid", "65534"]
    script = argv[argv.index("-c") + 1]
    assert f"--bind -o ro,X-mount.mkdir {prefix} /tmp/rlpost-python" in script
    assert ("/tmp/rlpost-python", "/opt/python") in _pairs(argv[setpriv:], "--ro-bind")
    destinations = [dest for _, dest in _pairs(argv[setpriv:], "--ro-bind")]
    assert not any(dest.startswith(("/root", "/home", str(tmp_path))) for dest in destinations)
    assert ("LD_LIBRARY_PATH", "/opt/python/lib") in _pairs(argv, "--setenv")


def test_command_as_root_binds_a_public_prefix_directly(monkeypatch) -> None:
    argv = _command(monkeypatch, 0, Interpreter("/usr/lib", "/opt/python/bin/python3"))
    assert "rlpost-python" not in argv[argv.index("-c") + 1]
    assert argv.count("/usr/bin/bwrap") == 1
    assert ("/usr/lib", "/opt/python") in _pairs(argv, "--ro-bind")


def test_command_as_root_mounts_tmpfs_capped_in_bytes_and_files(monkeypatch) -> None:
    argv = _command(monkeypatch, 0, Interpreter(None, "/usr/bin/python3.11"))
    # A private mount namespace, entered before the privileges are dropped.
    assert argv[3:8] == ["/usr/bin/unshare", "--mount", "--propagation", "private", "--"]
    assert argv.index("/usr/bin/unshare") < argv.index("/usr/bin/setpriv")
    script = argv[argv.index("-c") + 1].splitlines()
    capped = f"size={64 << 20},nr_inodes=4096"
    scratch = [line.split()[-1] for line in script if capped in line]
    assert scratch == ["/tmp/tmp", "/tmp/shm"] and script[-1] == 'exec "$@"'
    # bwrap binds those mounts, and makes no uncapped tmpfs of its own.
    assert [("/tmp/shm", "/dev/shm"), ("/tmp/tmp", "/tmp")] == _pairs(argv, "--bind")
    assert "--tmpfs" not in argv


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux unshare")
def test_command_without_root_mounts_capped_tmpfs_in_a_user_namespace(monkeypatch) -> None:
    if not _user_mounts(TOOLS.unshare, TOOLS.sh):
        pytest.skip("this kernel refuses unprivileged user namespaces")
    argv = _command(monkeypatch, 1000, Interpreter(None, "/usr/bin/python3.11"))
    assert argv[3:6] == ["/usr/bin/unshare", "--user", "--map-root-user"]
    assert "/usr/bin/setpriv" not in argv and "--tmpfs" not in argv
    assert "nr_inodes=4096" in argv[argv.index("-c") + 1]


def test_interpreter_is_this_python_seen_from_inside() -> None:
    interpreter = command.find_interpreter()
    if interpreter.host_prefix is None:
        assert interpreter.executable == os.path.realpath(sys.executable)
    else:
        assert interpreter.executable.startswith("/opt/python/")
        relative = interpreter.executable.removeprefix("/opt/python/")
        assert os.access(os.path.join(interpreter.host_prefix, relative), os.X_OK)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "required"),
        (["run"], "required"),
        (["run", "x.py", "--bogus"], "unrecognized arguments"),
        (["run", "x.py", "--timeout", "soon"], "invalid float value"),
        (["run", "x.py", "--timeout", "-1"], "timeout_s=-1.0"),
        (["run", "x.py", "--memory", "10"], "memory_mb=10"),
        (["run", "x.py", "--run-limits", "cgroups"], "invalid choice: 'cgroups'"),
        (["check", "--run-limits", "off"], "invalid choice: 'off'"),
        (["run", "/nonexistent/prog.py"], "cannot read /nonexistent/prog.py"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line(argv, fragment, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("rlpost sandbox: error:")


def test_format_result_shows_every_field() -> None:
    text = cli.format_result(SandboxResult("error", 3, "out\n", "err\n", 0.25))
    assert text.splitlines() == [
        "status:    error",
        "exit code: 3",
        "time:      0.250 s",
        "--- stdout ---",
        "out",
        "--- stderr ---",
        "err",
    ]
