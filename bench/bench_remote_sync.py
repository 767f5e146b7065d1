"""Remote training's sync bytes: what ``metrics.jsonl`` reports per step for each codec.

Trains a few GRPO steps against one ``rlpost serve`` on 127.0.0.1 with
``sync.codec=bf16``, ``fp8`` and ``bf16`` + ``sync.codec.delta=true`` at lr 1e-6, and
prints each run's per-step ``sync_bytes`` (the bytes the run's weight path put on
the wire) and the ratios against the bf16 run of the same invocation, with the
model's float32 size for reference (what every run reported before the weight path
counted the wire).

    python bench/bench_remote_sync.py                 # the ~25M model (bench/model_sizes.py)
    python bench/bench_remote_sync.py --size tiny --steps 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from model_sizes import QUIET_RUN, SIZES
from serve_util import start_server

from rlpost.config import load_config
from rlpost.models.tiny import save_tiny_checkpoint
from rlpost.pipeline.loop import train

SPREAD_REWARD = 'reward.terms=[{"name": "repetition", "kind": "rule", "n": 1, "unit": "char"}]'
RUNS = {
    "bf16": ["sync.codec=bf16"],
    "fp8": ["sync.codec=fp8"],
    "bf16+delta": ["sync.codec=bf16", "sync.codec.delta=true"],
}


def run(model_dir: Path, out: Path, name: str, steps: int, sft: int) -> list[dict]:
    proc, url = start_server(model_dir, "--threads", "1", "--max-tokens-limit", "64")
    try:
        over = [
            f"run.output_dir={out}",
            f"run.name={name}",
            "run.threads=1",
            f"model.path={model_dir}",
            "rollout.engine=remote",
            f"rollout.engine.servers={json.dumps([url])}",
            f"sft.steps={sft}",
            f"train.steps={steps}",
            "train.optim.lr=1e-6",
            "rollout.prompts_per_step=2",
            "rollout.n=2",
            "rollout.max_tokens=6",
            "train.mini_batch_size=4",
            "train.micro_batch_size=4",
            # an untrained model scores 0 everywhere (zero advantages): the entropy bonus
            # keeps every update non-zero, as a real run's would be
            "algo.entropy_coef=0.01",
            "eval.limit=2",
            *QUIET_RUN,
            *RUNS[name],
        ]
        result = train(load_config(None, over))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rows = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, rows) if "loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="25M", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sft-steps", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_checkpoint(Path(tmp) / "model", **SIZES[args.size])
        fp32 = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        out = Path(tmp) / "runs"
        got = {name: run(model_dir, out, name, args.steps, args.sft_steps) for name in RUNS}
    print(f"model {args.size}: checkpoint {fp32:,} bytes (float32, with headers)")
    for name, rows in got.items():
        sent = ", ".join(f"{r['sync_bytes']:,.0f}" for r in rows)
        norms = ", ".join(f"{r['grad_norm']:.3g}" for r in rows)
        print(f"{name:>11}: sync_bytes per step {sent}  (grad_norm {norms})")
    bf16 = got["bf16"][-1]["sync_bytes"]
    fp8 = got["fp8"][-1]["sync_bytes"]
    delta = max(r["sync_bytes"] for r in got["bf16+delta"])
    print(f"fp8 / bf16 bytes:   {fp8 / bf16:.3f}  (bar <= 0.55)")
    print(f"delta / bf16 bytes: {delta / bf16:.3f}  (bar <= 0.1, worst step)")


if __name__ == "__main__":
    main()
