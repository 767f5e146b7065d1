"""Throughput of sandboxed runs against unsandboxed ones, measured in the same run.

N trivial programs go through ``SandboxPool`` (bubblewrap, uid drop, rlimits,
pinned CPU, supervised pipes) and through plain
``subprocess.run([sys.executable, "-E", "-s", "-S", "-c", code])`` with no
isolation, both from a thread pool of the same size. The sandbox runs once per
``run_limits`` setting: ``none`` (per-process rlimits only, the limits before
per-run bounds: the baseline), ``seccomp`` (the filter, no cgroup) and ``auto``
(a cgroup per run where the host allows one). The sides alternate for
``--repeats`` rounds, each round starting with another setting, so changes in
machine load hit all alike; printed are the
median programs/s of each and the ratios (the sandbox's cost is mostly
namespace setup and the extra process layers, paid once per program; the
cgroup adds a mkdir, a few control-file writes and an rmdir per run).

    python bench/bench_sandbox.py [--n 64] [--workers CPUS] [--repeats 3]
                                  [--run-limits none,seccomp,auto]
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

from rlpost.rewards.sandbox import SandboxConfig, SandboxPool
from rlpost.rewards.sandbox.limits import RUN_LIMITS
from rlpost.rewards.sandbox.plan import plan
from rlpost.rewards.sandbox.runner import PYTHON_FLAGS

BASELINE = "none"


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


def _describe(mode: str) -> str:
    limits = plan(mode)
    cgroups = ",".join(f"{c.name}(v{c.version})" for c in limits.controllers) or "no cgroup"
    return f"{cgroups}; seccomp refuses {len(limits.blocked)} calls"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="programs per batch")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per side")
    parser.add_argument(
        "--run-limits",
        default="none,seccomp,auto",
        help=f"comma-separated settings to time (of {', '.join(RUN_LIMITS)}); "
        f"'{BASELINE}' is the baseline the others are compared with",
    )
    args = parser.parse_args(argv)
    modes = args.run_limits.split(",")
    if BASELINE not in modes or not set(modes) <= set(RUN_LIMITS):
        parser.error(f"--run-limits={args.run_limits}: list settings of {RUN_LIMITS} incl. none")
    programs = make_programs(args.n)
    codes = [code for code, _ in programs]
    expected = [out for _, out in programs]
    plain_s: list[float] = []
    sandbox_s: dict[str, list[float]] = {mode: [] for mode in modes}
    pools = {mode: SandboxPool(args.workers, SandboxConfig(run_limits=mode)) for mode in modes}
    try:
        for round_ in range(args.repeats):
            plain_s.append(timed(lambda: run_plain(codes, args.workers), expected))
            # Each round starts with another setting, so no side always runs last.
            for mode in modes[round_ % len(modes) :] + modes[: round_ % len(modes)]:
                pool = pools[mode]
                sandbox_s[mode].append(
                    timed(lambda pool=pool: [r.stdout for r in pool.map(codes)], expected)
                )
    finally:
        for pool in pools.values():
            pool.close()
    plain_rate = args.n / statistics.median(plain_s)
    rates = {mode: args.n / statistics.median(times) for mode, times in sandbox_s.items()}
    print(f"programs: {args.n} per batch, workers: {args.workers}, rounds: {args.repeats}")
    print(f"plain subprocess (no isolation):    {plain_rate:8.1f} programs/s")
    for mode, rate in rates.items():
        print(f"sandbox run_limits={mode:<8}       {rate:8.1f} programs/s  ({_describe(mode)})")
    for mode, rate in rates.items():
        if mode != BASELINE:
            ratio = rate / rates[BASELINE]
            print(f"ratio {mode}/{BASELINE} (cost of the per-run limits): {ratio:.2f}x")
    ratio = rates[modes[-1]] / plain_rate
    print(f"ratio sandbox {modes[-1]}/plain: {ratio:.2f}x ({1 / ratio:.2f}x slower)")


if __name__ == "__main__":
    main()
