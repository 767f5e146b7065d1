"""``rlpost sandbox run FILE.py [--timeout S] [--memory MB] [--stdin FILE] [--run-limits M] [--json]``
and ``rlpost sandbox check [--run-limits M]``.

``run`` exits 0 when the status is ``ok``, else 1; ``check`` prints one line per limit and
exits 0 only when every limit holds. Bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import NoReturn

from rlpost.rewards.sandbox.command import SandboxUnavailable
from rlpost.rewards.sandbox.limits import RUN_LIMITS, SandboxConfig, SandboxResult
from rlpost.rewards.sandbox.runner import run_code

PROG = "rlpost sandbox"


class _UsageError(Exception):
    """Bad command line; the message is the one line shown to the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print the whole usage block
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Run untrusted Python in the sandbox.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("run", help="run one Python file in a fresh sandbox")
    run.add_argument("file", help="Python source file to run as main.py")
    run.add_argument(
        "--timeout",
        type=float,
        default=SandboxConfig.timeout_s,
        metavar="S",
        help="wall-clock limit in seconds (default %(default)s)",
    )
    run.add_argument(
        "--memory",
        type=int,
        default=SandboxConfig.memory_mb,
        metavar="MB",
        help="memory limit in MiB: each process's address space, and the whole run's "
        "memory where a per-run cgroup is available (default %(default)s)",
    )
    run.add_argument("--stdin", metavar="FILE", help="file whose text is the program's stdin")
    _run_limits_option(run)
    run.add_argument("--json", action="store_true", help="print the result as one JSON object")
    check = commands.add_parser("check", help="say which limits hold on this host, one line each")
    _run_limits_option(check)
    return parser


def _run_limits_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-limits",
        choices=RUN_LIMITS,
        default=SandboxConfig.run_limits,
        help="how the whole run is bounded: cgroup where possible (auto), cgroup or refuse, "
        "seccomp only, or per-process rlimits only (default %(default)s)",
    )


def main(argv: list[str]) -> int:
    """Entry point for ``rlpost sandbox ...``; ``argv`` excludes ``rlpost sandbox``."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "check":
            return _check(args.run_limits)
        config = SandboxConfig(
            timeout_s=args.timeout, memory_mb=args.memory, run_limits=args.run_limits
        )
        code = _read(args.file)
        stdin = _read(args.stdin) if args.stdin else ""
    except (_UsageError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_code(code, stdin=stdin, config=config)
    except SandboxUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(result)) if args.json else format_result(result))
    return 0 if result.ok else 1


def _check(mode: str) -> int:
    from rlpost.rewards.sandbox.check import run_check

    try:
        lines = run_check(mode)
    except SandboxUnavailable as exc:
        print(f"sandbox   unavailable {exc}")
        return 1
    for line in lines:
        print(line.render())
    return 0 if all(line.ok for line in lines) else 1


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise _UsageError(f"cannot read {path}: {exc.strerror}") from None


def format_result(result: SandboxResult) -> str:
    """Human-readable block: status, exit code, time, then stdout and stderr."""
    lines = [
        f"status:    {result.status}",
        f"exit code: {result.exit_code}",
        f"time:      {result.wall_seconds:.3f} s",
        "--- stdout ---",
        result.stdout.rstrip("\n"),
        "--- stderr ---",
        result.stderr.rstrip("\n"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
