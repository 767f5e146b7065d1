"""The Tinker cookbook's RL loop through ``rlpost tinker``: learning and cost against ``rlpost train``.

Starts ``rlpost tinker --model MODEL`` and runs the cookbook's ``rl.train`` with its arithmetic
environment (LoRA, ``importance_sampling``, ``--groups`` x ``--group-size`` samples of up to
``--max-tokens`` per iteration) for ``--minutes``; held-out accuracy (greedy, 100 fixed sums,
the environment's own prompt and answer check) is measured before, and on every checkpoint the
run saved (one each 5 iterations), through samplers of the same service. Then ``rlpost train grpo_arith`` runs the same batch shape (LoRA, the same
model, ``--steps`` steps) and the seconds per iteration of both are printed side by side (each
run's wall time after its first iteration, over the iterations that followed).

    python bench/bench_tinker.py --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        [--minutes 30] [--groups 8] [--group-size 8] [--max-tokens 16] [--steps 3] [--plot PNG]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def accuracy(url: str, model: str, path: str | None, n: int = 100) -> float:
    import tinker
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv, _extract_final_int
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    service = tinker.ServiceClient(base_url=url)
    sampler = service.create_sampling_client(model_path=path, base_model=None if path else model)
    sampler = sampler.result()
    renderer = renderers.get_renderer("role_colon", get_tokenizer(model))
    rng, prefix = np.random.RandomState(1234), ArithmeticEnv.standard_fewshot_prefix()
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=renderer.get_stop_sequences())
    futures, answers = [], []
    for _ in range(n):
        x, y = int(rng.randint(0, 101)), int(rng.randint(0, 101))
        msgs = [*prefix, {"role": "user", "content": f"What is {x} + {y}?"}]
        futures.append(sampler.sample(renderer.build_generation_prompt(msgs), 1, params))
        answers.append(x + y)
    tok = get_tokenizer(model)
    got = [_extract_final_int(tok.decode(f.result().sequences[0].tokens)) for f in futures]
    service.close("success").result()
    return float(np.mean([g == a for g, a in zip(got, answers, strict=True)]))


def cookbook_rl(url: str, model: str, log: Path, args) -> list[dict]:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    data = ArithmeticDatasetBuilder(
        batch_size=args.groups, model_name_for_tokenizer=model, renderer_name="role_colon",
        n_batches=10_000, group_size=args.group_size,
    )  # fmt: skip
    cfg = train.Config(
        learning_rate=args.lr, dataset_builder=data, model_name=model, recipe_name="bench",
        max_tokens=args.max_tokens, log_path=str(log), eval_every=0, save_every=5,
        renderer_name="role_colon", lora_rank=32, base_url=url, ttl_seconds=None,
        max_steps=args.max_iterations,
    )  # fmt: skip
    start = time.time()

    async def run():
        task = asyncio.create_task(train.main(cfg))
        while not task.done() and time.time() - start < args.minutes * 60:
            await asyncio.sleep(5)
        task.cancel()

    asyncio.run(run())
    metrics = log / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return [r for r in rows if "time/total" in r]


def phases(steps: list[dict]) -> str:
    """Mean seconds of each of the cookbook's timed phases over the iterations after the first."""
    keys = sorted(
        {
            k
            for r in steps[1:]
            for k in r
            if k.startswith("time/") and k != "time/total" and ":" not in k
        }
    )
    means = {k: np.mean([r[k] for r in steps[1:] if k in r]) for k in keys}
    top = sorted(means.items(), key=lambda kv: -kv[1])[:8]
    return ", ".join(f"{k[5:]} {v:.1f}" for k, v in top)


def curve(url, model, log: Path, steps: list[dict], before: float, plot: str | None) -> list:
    """Held-out accuracy of each saved sampler: (iteration, minutes into the run, accuracy)."""
    saved = log / "checkpoints.jsonl"
    rows = [json.loads(x) for x in saved.read_text().splitlines()] if saved.exists() else []
    ends = np.cumsum([r["time/total"] for r in steps])
    points = []
    for row in rows:
        if row.get("sampler_path"):
            it = int(row.get("batch", 0))
            minutes = float(ends[min(it, len(ends)) - 1]) / 60 if it else 0.0
            points.append((it, minutes, accuracy(url, model, row["sampler_path"])))
            print(f"  iteration {it:3d} ({minutes:4.1f} min): {points[-1][2]:.2f}", flush=True)
    if plot and points:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = [(0, 0.0, before), *points]
        ax.plot([p[1] for p in drawn], [p[2] for p in drawn], marker="o")
        ax.set(
            xlabel="minutes",
            ylabel="held-out accuracy",
            title="cookbook rl.train via rlpost tinker",
        )
        fig.tight_layout()
        fig.savefig(plot)
        print(f"plot: {plot}")
    return points


def rlpost_train(model: str, out: Path, args) -> float:
    """Seconds per step of ``rlpost train grpo_arith`` at the same shape, after the first (from
    the step rows' times, so the held-out evaluation before the first step is not counted)."""
    cmd = [sys.executable, "-m", "rlpost.cli", "train", "grpo_arith", f"model.path={model}",
           f"rollout.prompts_per_step={args.groups}", f"rollout.n={args.group_size}",
           f"rollout.max_tokens={args.max_tokens}", f"train.steps={args.steps}", "sft.steps=0",
           f"train.mini_batch_size={args.groups * args.group_size}",
           f"train.micro_batch_size={args.micro_batch}", "model.lora.rank=32",
           f"run.output_dir={out.parent}", f"run.name={out.name}", "eval.every=0",
           "eval.limit=16"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode:
        raise SystemExit(f"rlpost train failed: {proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if "loss" in r]
    return float(np.mean(np.diff(times))) if len(times) > 1 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)  # 4e-4 gains, then collapses
    p.add_argument("--max-iterations", type=int, default=None)
    p.add_argument("--steps", type=int, default=3, help="rlpost train steps for the cost row")
    p.add_argument("--micro-batch", type=int, default=8, help="rlpost train's micro-batch")
    p.add_argument("--plot", default=None, help="a PNG of held-out accuracy against minutes")
    args = p.parse_args()
    from tests.integration.test_tinker_service import start, stop

    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    model = str(Path(args.model).expanduser())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc, url = start(model, tmp / "state")
        try:
            before = accuracy(url, model, None)
            steps = cookbook_rl(url, model, tmp / "rl", args)
            api_s = np.mean([r["time/total"] for r in steps[1:]]) if len(steps) > 1 else np.nan
            print(f"{len(steps)} iterations, {api_s:.1f} s each after the first: {phases(steps)}")
            print("held-out accuracy of each saved sampler:", flush=True)
            points = curve(url, model, tmp / "rl", steps, before, args.plot)
        finally:
            stop(proc)
        after = points[-1][2] if points else float("nan")
        best = max(points, key=lambda p: p[2]) if points else (0, 0.0, float("nan"))
        print(f"held-out accuracy: {before:.2f} -> {after:.2f} "
              f"({(after - before) * 100:+.0f} points) after {len(steps)} iterations "
              f"in {args.minutes} min; best {best[2]:.2f} at iteration {best[0]} "
              f"({best[1]:.1f} min); API {api_s:.1f} s an iteration", flush=True)  # fmt: skip
        train_s = rlpost_train(model, tmp / "run", args)
    print(f"seconds per iteration: API {api_s:.1f}, rlpost train {train_s:.1f} "
          f"(ratio {api_s / train_s:.2f}, bar 1.3)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
