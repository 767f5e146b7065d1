"""Threads and OpenMP waiting: rlpost's step rate on a quiet core pair and beside a CPU burner.

    python bench/bench_threads.py              # tiny and ~25M, 2 rounds
    python bench/bench_threads.py --quick      # 1 round, fewer steps

Runs rlpost's GRPO step (the ``bench_vs_trl`` settings: 16 prompts x 8
samples, 8 tokens, one optimizer step, fp32) in a fresh process per
configuration: torch threads 1 or 2, OpenMP threads spinning while they wait
(``OMP_WAIT_POLICY=ACTIVE``, what libgomp does by default for a while) or
sleeping (``PASSIVE``), and with or without a burner (one process spinning on
one core, the "another job took a core" case). Configurations alternate
within each round; medians over rounds are printed with the ratio to
1 thread / passive in the same burner state, and the load average.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_vs_trl import GROUP, PROMPTS, SIZES  # noqa: E402

BURN = "while True: pass"


def one_run(ckpt: str, threads: int, policy: str, steps: int, dtype: str) -> float:
    root = str(HERE.parent)
    env = dict(os.environ, OMP_WAIT_POLICY=policy, PYTHONPATH=root)
    cmd = [sys.executable, str(HERE / "bench_vs_trl.py"), "--worker", "rlpost", "--dtype", dtype]
    cmd += ["--ckpt", ckpt, "--steps", str(steps), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"run failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    seconds = json.loads(line[len("RESULT ") :])["step_seconds"][1:]
    return PROMPTS * GROUP / statistics.median(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="tiny,25M")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--quick", action="store_true", help="1 round of 3 steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 3
    from rlpost.models.tiny import save_tiny_checkpoint

    print(f"{os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; dtype {args.dtype}")
    configs = list(itertools.product([False, True], [1, 2], ["PASSIVE", "ACTIVE"]))
    for name in args.sizes.split(","):
        ckpt = str(
            save_tiny_checkpoint(
                tempfile.mkdtemp(prefix="bench-threads-"),
                max_position_embeddings=128,
                **SIZES[name],
            )
        )
        rates: dict[tuple, list[float]] = {}
        loads: dict[tuple, list[float]] = {}
        for r in range(args.rounds):
            for burner, threads, policy in configs if r % 2 == 0 else configs[::-1]:
                burn = subprocess.Popen([sys.executable, "-c", BURN]) if burner else None
                try:
                    load = os.getloadavg()[0]
                    rate = one_run(ckpt, threads, policy, args.steps, args.dtype)
                finally:
                    if burn is not None:
                        burn.kill()
                        burn.wait()
                rates.setdefault((burner, threads, policy), []).append(rate)
                loads.setdefault((burner, threads, policy), []).append(load)
                print(
                    f"  {name} round {r + 1} burner={'on ' if burner else 'off'} threads={threads} "
                    f"{policy:>7}: {rate:7.1f} completions/s  load {load:.2f}",
                    flush=True,
                )
        print(f"\n{name}: | burner | threads | OMP_WAIT_POLICY | completions/s | vs 1 thread |")
        print("| --- | ---: | --- | ---: | ---: |")
        for burner, threads, policy in configs:
            med = statistics.median(rates[(burner, threads, policy)])
            base = statistics.median(rates[(burner, 1, "PASSIVE")])
            print(
                f"| {'on' if burner else 'off'} | {threads} | {policy} | {med:.1f} | "
                f"{med / base:.2f}x |"
            )
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
