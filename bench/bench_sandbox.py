"""Throughput of sandboxed runs against unsandboxed ones, measured in the same run.

N trivial programs go through ``SandboxPool`` (bubblewrap, uid drop, rlimits,
pinned CPU, supervised pipes) and through plain
``subprocess.run([sys.executable, "-E", "-s", "-S", "-c", code])`` with no
isolation, both from a thread pool of the same size. The two sides alternate
for ``--repeats`` rounds so changes in machine load hit both alike; printed are
the median programs/s of each and their ratio (the sandbox's cost is mostly
namespace setup and the extra process layers, paid once per program).

    python bench/bench_sandbox.py [--n 64] [--workers CPUS] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rlpost.rewards.sandbox import SandboxPool
from rlpost.rewards.sandbox.runner import PYTHON_FLAGS


def make_programs(n: int) -> list[tuple[str, str]]:
    """``n`` distinct trivial programs and the stdout each must print."""
    return [(f"print(sum(range({i * 100})))\n", f"{sum(range(i * 100))}\n") for i in range(n)]


def run_plain(codes: list[str], workers: int) -> list[str]:
    def one(code: str) -> str:
        argv = [sys.executable, *PYTHON_FLAGS, "-c", code]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout

    with ThreadPoolExecutor(workers) as executor:
        return list(executor.map(one, codes))


def timed(fn: Callable[[], list[str]], expected: list[str]) -> float:
    """Seconds one batch took; a wrong output aborts the benchmark."""
    start = time.perf_counter()
    outputs = fn()
    elapsed = time.perf_counter() - start
    if outputs != expected:
        raise SystemExit("a program printed the wrong result; the comparison would be meaningless")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="programs per batch")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per side")
    args = parser.parse_args(argv)
    programs = make_programs(args.n)
    codes = [code for code, _ in programs]
    expected = [out for _, out in programs]
    plain_s, sandbox_s = [], []
    with SandboxPool(args.workers) as pool:
        for _ in range(args.repeats):
            plain_s.append(timed(lambda: run_plain(codes, args.workers), expected))
            sandbox_s.append(timed(lambda: [r.stdout for r in pool.map(codes)], expected))
    plain_rate = args.n / statistics.median(plain_s)
    sandbox_rate = args.n / statistics.median(sandbox_s)
    print(f"programs: {args.n} per batch, workers: {args.workers}, rounds: {args.repeats}")
    print(f"plain subprocess (no isolation): {plain_rate:8.1f} programs/s")
    print(f"sandbox pool (bwrap + rlimits):  {sandbox_rate:8.1f} programs/s")
    ratio = sandbox_rate / plain_rate
    print(f"ratio sandbox/plain: {ratio:.2f}x ({1 / ratio:.2f}x slower)")


if __name__ == "__main__":
    main()
