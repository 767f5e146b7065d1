"""Overhead of metric recording on a training loop, measured against no recording in the same run.

A fake training step is a float32 matmul workload calibrated to about 50 ms.
The same loop runs without a recorder and with one (JSONL + Prometheus
endpoint, scraped once a second by a background thread, as a real Prometheus
would), alternating step by step so that changes in machine load hit both
sides alike. Printed: mean and median step time of each, the overhead (ratio
of means, and median of the per-pair ratios, which shrugs off load spikes from
other processes; target < 3 %), and the cost of one ``record()`` call alone.

    python bench/bench_metrics_overhead.py [--steps 40] [--block 1] [--threads 1]

``time_steps`` is the reusable harness: time any per-step callable.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from rlpost.observe.recorder import Recorder

TARGET_OVERHEAD_PCT = 3.0


def time_steps(fn: Callable[[int], object], n: int) -> list[float]:
    """Call ``fn(step)`` for steps 1..n; return each call's wall time in seconds."""
    times = []
    for step in range(1, n + 1):
        start = time.perf_counter()
        fn(step)
        times.append(time.perf_counter() - start)
    return times


def make_workload(target_seconds: float = 0.05, size: int = 384) -> Callable[[int], float]:
    """A step of ``k`` chained ``size x size`` matmuls, ``k`` chosen to take ``target_seconds``."""
    a = torch.randn(size, size) / size**0.5
    b = torch.randn(size, size) / size**0.5

    def run(k: int) -> float:
        x = a
        for _ in range(k):
            x = x @ b
        return float(x[0, 0])

    run(3)
    one = min(time_steps(lambda _: run(10), 5)) / 10
    k = max(1, round(target_seconds / one))
    return lambda step: run(k)


def fake_metrics(step: int) -> dict[str, float]:
    """The keys a real step records: the exported ones and a few JSONL-only ones."""
    x = float(step)
    return {
        "reward_mean": 0.5 + 0.001 * x,
        "reward_std": 0.2,
        "kl": 0.01 * x,
        "response_length_mean": 100.0,
        "clip_frac": 0.05,
        "rollout_tps": 1500.0,
        "mfu": 0.3,
        "sync_seconds": 0.02,
        "rollout_utilization": 0.7,
        "train_utilization": 0.6,
        "sample_lag": 0.5,
        "sample_drop_ratio": 0.01,
        "loss": 1.0 / x,
        "grad_norm": 0.8,
        "lr": 1e-5,
        "truncated_frac": 0.02,
        "zero_spread_frac": 0.1,
    }


def scrape_forever(port: int, stop: threading.Event, every: float = 1.0) -> None:
    while not stop.wait(every):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            resp.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per side")
    parser.add_argument("--block", type=int, default=1, help="steps per side before switching")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = make_workload()
    base: list[float] = []
    recorded: list[float] = []
    record_only: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, Recorder(Path(tmp), prometheus_port=0) as rec:
        stop = threading.Event()
        scraper = threading.Thread(target=scrape_forever, args=(rec.port, stop), daemon=True)
        scraper.start()

        def with_recorder(step: int) -> None:
            workload(step)
            start = time.perf_counter()
            rec.record(step, fake_metrics(step))
            record_only.append(time.perf_counter() - start)

        try:
            sides = [(base, workload), (recorded, with_recorder)]
            for block in range(-(-args.steps // args.block)):
                n = min(args.block, args.steps - block * args.block)
                for times, fn in sides if block % 2 == 0 else sides[::-1]:
                    times += time_steps(fn, n)
        finally:
            stop.set()
            scraper.join(timeout=10)
    mean_base, mean_rec = statistics.mean(base), statistics.mean(recorded)
    overhead = 100.0 * (mean_rec / mean_base - 1.0)
    paired = 100.0 * (statistics.median(r / b for r, b in zip(recorded, base, strict=True)) - 1.0)
    record_us = 1e6 * statistics.mean(record_only)
    print(f"torch threads: {torch.get_num_threads()}; steps: {len(base)} per side")
    print(
        f"without recorder: {1e3 * mean_base:.2f} ms/step (median {1e3 * statistics.median(base):.2f})"
    )
    print(
        f"with recorder:    {1e3 * mean_rec:.2f} ms/step (median {1e3 * statistics.median(recorded):.2f})"
    )
    print(f"overhead: {overhead:+.2f} % (ratio of means), {paired:+.2f} % (median paired ratio)")
    print(f"target: < {TARGET_OVERHEAD_PCT:g} %")
    record_median_us = 1e6 * statistics.median(record_only)
    print(
        f"record() alone: {record_us:.0f} us/call mean, {record_median_us:.0f} us median"
        f" = {100 * record_us / (1e6 * mean_base):.2f} % of a mean step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
