"""A/B of the rollout correction on the default bf16 path: which learns better over seeds.

Runs ``bench/bench_grpo_file.py`` (a task no recipe names, ``rlpost train grpo_file`` on a real
checkpoint, ``model.dtype=auto``) once per arm and seed, the arms of one seed side by side
(``--threads`` each), and prints per seed and on average: held-out accuracy at T=1 after
training, its gain over the start, the mean training reward over all steps, and the mean
``logprob_gap`` (engine against trainer, nats a token). Arms: ``none`` (no correction) and
``tis`` (truncated importance sampling, ``algo.rollout_correction.name=tis``).

``model.dtype=auto`` is bf16 only where the CPU has bf16 (AVX-512 BF16 or AMX) or on a GPU;
elsewhere it is float32, the gap is about 1e-5 and the arms train alike. ``--set
model.dtype=bfloat16`` forces the bf16 path, which such a CPU emulates (a bf16 matmul about 9x
slower than float32).

    python bench/bench_correction_ab.py --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        [--seeds 1 2 3] [--steps 10] [--threads 1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = {"none": [], "tis": ["algo.rollout_correction.name=tis"]}


def metrics(run_root: Path) -> list[dict]:
    """The run's per-step metric rows (``metrics.jsonl`` of its one run directory)."""
    path = next(run_root.glob("runs/*/metrics.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_of(rows: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the rows that carry it (None if none does)."""
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else None


def run_seed(seed: int, args, root: Path) -> dict[str, dict]:
    """Both arms of one seed at once; each arm's summary plus its step means."""
    procs = {}
    for arm, extra in ARMS.items():
        out = root / f"seed{seed}_{arm}"
        command = [
            sys.executable, str(HERE / "bench_grpo_file.py"), "--model", args.model,
            "--steps", str(args.steps), "--threads", str(args.threads), "--out", str(out),
            "--set", f"run.seed={seed}", *extra, *args.set,
        ]  # fmt: skip
        log = (root / f"seed{seed}_{arm}.log").open("w")
        procs[arm] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), out)
    result = {}
    for arm, (proc, out) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"seed {seed} arm {arm} failed: see {root}/seed{seed}_{arm}.log")
        summary = json.loads(next(out.glob("runs/*/summary.json")).read_text())
        rows = metrics(out)
        result[arm] = {
            "acc_start": summary["eval_accuracy_start"],
            "acc_end": summary["eval_accuracy_end"],
            "acc_stderr_end": summary["eval_accuracy_stderr_end"],
            "reward_mean": mean_of(rows, "reward_mean"),
            "logprob_gap": mean_of(rows, "logprob_gap"),
        }
        print(f"seed {seed} {arm:>4}: {json.dumps(result[arm])}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local HF checkpoint directory or .gguf")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="threads of each arm's run")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    args = parser.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="correction_ab_"))
    root.mkdir(parents=True, exist_ok=True)
    seeds = {seed: run_seed(seed, args, root) for seed in args.seeds}
    print(f"\n{'arm':>5} {'acc start':>10} {'acc end':>8} {'gain':>7} {'reward':>7} {'gap':>7}")
    means = {}
    for arm in ARMS:
        rows = [seeds[s][arm] for s in args.seeds]
        mean = {k: statistics.fmean(r[k] for r in rows) for k in ("acc_start", "acc_end")}
        mean["gain"] = mean["acc_end"] - mean["acc_start"]
        for key in ("reward_mean", "logprob_gap"):
            got = [r[key] for r in rows if r[key] is not None]
            mean[key] = statistics.fmean(got) if got else float("nan")
        means[arm] = mean
        print(
            f"{arm:>5} {mean['acc_start']:>10.3f} {mean['acc_end']:>8.3f} {mean['gain']:>+7.3f} "
            f"{mean['reward_mean']:>7.3f} {mean['logprob_gap']:>7.4f}"
        )
    wins = sum(seeds[s]["tis"]["acc_end"] > seeds[s]["none"]["acc_end"] for s in args.seeds)
    ratio = means["tis"]["gain"] / means["none"]["gain"] if means["none"]["gain"] else float("nan")
    print(
        f"tis/none held-out gain ratio {ratio:.3f}; tis ahead in {wins} of {len(args.seeds)} seeds"
    )
    (root / "ab.json").write_text(json.dumps({"seeds": seeds, "means": means}, indent=1))
    print(f"runs and ab.json under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
