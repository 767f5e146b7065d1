"""A short GRPO job with ``rollout.engine=vllm`` against the in-process engine (GPU machine).

Runs the default recipe (arithmetic, verifiable reward) on ``--model`` (a
local Hugging Face checkpoint, e.g. a 0.5B instruct model) for ``--steps``
steps with vLLM as the rollout engine, then the same job with
``rollout.engine=hf`` as the baseline measured in the same run, and prints
rollout tokens/s, seconds per step and the ratio. Needs a GPU and the extra:
``pip install 'rlpost[vllm]'``; without vLLM it stops with the one-line
message naming the extra.

    python bench/bench_vllm_grpo.py --model /models/qwen2.5-0.5b-instruct \\
        [--steps 10] [--prompts 64] [--n 8] [--max-tokens 256] [--no-baseline]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from rlpost.config import RECIPES_DIR, ConfigError, load_config
from rlpost.models.loading import ModelLoadError
from rlpost.pipeline.loop import train

RECIPE = RECIPES_DIR / "grpo_arith.yaml"


def run_job(engine: str, args, out_dir: str) -> dict[str, float]:
    overrides = [
        f"model.path={args.model}",
        "model.dtype=bfloat16",
        f"rollout.engine={engine}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}",
        f"train.steps={args.steps}",
        f"train.mini_batch_size={args.prompts * args.n}",
        f"train.micro_batch_size={args.micro_batch}",
        "sft.steps=0",
        "eval.every=0",
        "eval.limit=32",
        "checkpoint.every=0",
        "observe.progress=false",
        f"run.output_dir={out_dir}",
        f"run.name=bench_{engine}",
        "run.threads=0",
    ]
    result = train(load_config(RECIPE, overrides))
    steps = result.history[1:] or result.history  # the first step includes warm-up
    return {
        "rollout_tps": statistics.mean(h["rollout_tps"] for h in steps),
        "step_seconds": statistics.mean(h["step_seconds"] for h in steps),
        "rollout_share": statistics.mean(h["rollout_utilization"] for h in steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local HF checkpoint directory")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--no-baseline", action="store_true", help="skip the rollout.engine=hf run")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            results["vllm"] = run_job("vllm", args, out_dir)
            if not args.no_baseline:
                results["hf"] = run_job("hf", args, out_dir)
        except (ImportError, ConfigError, ModelLoadError) as exc:
            print(f"bench_vllm_grpo: {exc}", file=sys.stderr)
            return 2
    print(
        f"GRPO, {args.steps} steps of {args.prompts} prompts x n={args.n}, max_tokens {args.max_tokens}"
    )
    for name, r in results.items():
        line = (
            f"  {name:5s} rollout {r['rollout_tps']:9.0f} tokens/s  {r['step_seconds']:6.2f} s/step"
        )
        line += f"  rollout share {r['rollout_share']:.0%}"
        if name == "vllm" and "hf" in results:
            line += (
                f"  x{r['rollout_tps'] / results['hf']['rollout_tps']:.1f} rollout tokens/s vs hf"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
