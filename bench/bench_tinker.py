"""The Tinker cookbook's RL loop through ``rlpost tinker``: learning and cost against ``rlpost train``.

Starts ``rlpost tinker --model MODEL`` and runs the cookbook's ``rl.train`` with its arithmetic
environment (LoRA, ``importance_sampling``, ``--groups`` x ``--group-size`` samples of up to
``--max-tokens`` per iteration) for ``--minutes``; held-out accuracy (greedy, 100 fixed sums,
the environment's own prompt and answer check) is measured before and after through a sampler
of the same service. Then ``rlpost train grpo_arith`` runs the same batch shape (LoRA, the same
model, ``--steps`` steps) and the seconds per iteration of both are printed side by side (each
run's wall time after its first iteration, over the iterations that followed).

    python bench/bench_tinker.py --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        [--minutes 30] [--groups 8] [--group-size 8] [--max-tokens 16] [--steps 3]
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


def cookbook_rl(url: str, model: str, log: Path, args) -> tuple[int, float]:
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
    steps = [r for r in rows if "time/total" in r]
    per_iter = (
        float(np.mean([r["time/total"] for r in steps[1:]])) if len(steps) > 1 else float("nan")
    )
    return len(steps), per_iter


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
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--max-iterations", type=int, default=None)
    p.add_argument("--steps", type=int, default=3, help="rlpost train steps for the cost row")
    p.add_argument("--micro-batch", type=int, default=8, help="rlpost train's micro-batch")
    args = p.parse_args()
    from tests.integration.test_tinker_service import start, stop

    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    model = str(Path(args.model).expanduser())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc, url = start(model, tmp / "state")
        try:
            before = accuracy(url, model, None)
            iterations, api_s = cookbook_rl(url, model, tmp / "rl", args)
            import tinker

            tc = tinker.ServiceClient(base_url=url)
            # The run's last checkpoint (every 5 iterations) is what is scored after.
            last = [json.loads(x) for x in (tmp / "rl" / "checkpoints.jsonl").read_text().splitlines()] \
                if (tmp / "rl" / "checkpoints.jsonl").exists() else []  # fmt: skip
            path = last[-1].get("sampler_path") if last else None
            after = accuracy(url, model, path) if path else float("nan")
            tc.close("success").result()
        finally:
            stop(proc)
        print(f"held-out accuracy: {before:.2f} -> {after:.2f} "
              f"({(after - before) * 100:+.0f} points) after {iterations} iterations "
              f"in {args.minutes} min; API {api_s:.1f} s an iteration", flush=True)  # fmt: skip
        train_s = rlpost_train(model, tmp / "run", args)
    print(f"seconds per iteration: API {api_s:.1f}, rlpost train {train_s:.1f} "
          f"(ratio {api_s / train_s:.2f}, bar 1.3)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
