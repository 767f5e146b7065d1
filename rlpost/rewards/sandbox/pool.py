"""Concurrent sandbox runs.

A thread supervises each run; runs are pinned round-robin over this process's CPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from rlpost.rewards.sandbox.limits import SandboxConfig, SandboxResult
from rlpost.rewards.sandbox.runner import check_available, run_code


class SandboxPool:
    """A fixed number of concurrent sandbox runs, results in input order."""

    def __init__(self, max_workers: int, config: SandboxConfig | None = None) -> None:
        if isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"SandboxPool max_workers={max_workers!r} must be >= 1")
        check_available()
        self.max_workers = max_workers
        self.config = config or SandboxConfig()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")

    def map(self, codes: Sequence[str], stdins: Sequence[str] | None = None) -> list[SandboxResult]:
        """Run each program (with the matching stdin, if given) in its own sandbox."""
        stdins = [""] * len(codes) if stdins is None else list(stdins)
        if len(stdins) != len(codes):
            raise ValueError(f"got {len(codes)} programs but {len(stdins)} stdins")
        return list(
            self._executor.map(
                lambda code, stdin: run_code(code, stdin=stdin, config=self.config), codes, stdins
            )
        )

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
