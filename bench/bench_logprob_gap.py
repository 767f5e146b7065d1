"""The engine's sampling logprobs against the trainer's on the same tokens: ``logprob_gap``.

Builds a run's trainer and in-process engine from ``grpo_file`` on a real checkpoint, samples
``--prompts`` x ``--n`` word problems at T=1 and scores the same tokens with the trainer's old
logprob pass; prints the mean and largest |engine - trainer| a token.

    python bench/bench_logprob_gap.py --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        [--dtype bfloat16] [--engine hf] [--prompts 6] [--n 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.resolved import ENGINES, resolve
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.train.batch import collate

QUESTIONS = [
    "What is 17 + 25?",
    "Tom has 12 apples and gives away 5. How many are left?",
    "Compute 40 - 13.",
    "Ana had 8 books. A friend gave her 9 more. How many books does she have?",
    "How much is 33 + 9?",
    "A shelf holds 30 cards. Zoe takes 11 away. How many are left?",
    "What is 21 - 7?",
    "Sam has 14 coins and buys 6 more. How many coins now?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = tempfile.mkdtemp()
    cfg = load_config(
        "grpo_file", [f"model.path={a.model}", f"model.dtype={a.dtype}", f"run.output_dir={out}"]
    )
    model, tok = build.build_policy(cfg)
    trainer = build.build_trainer_worker(cfg, copy.deepcopy(model), tok)
    engine = ENGINES.get(a.engine)(cfg, resolve(cfg), model, tok)
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS[: a.prompts]]
    encoded = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chat]
    ids = [list(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded]
    t0 = time.perf_counter()
    done = engine.generate(ids, SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=0), a.n)
    t1 = time.perf_counter()
    batch = collate(done, [0.0] * len(done), tok.pad_token_id)
    mask = batch.response_mask > 0
    gap = (batch.rollout_logprobs - trainer.logprobs(batch, "old"))[mask].abs()
    print(
        f"dtype={a.dtype} engine={a.engine} tokens={int(mask.sum())} "
        f"logprob_gap={gap.mean():.2e} max={gap.max():.2e} "
        f"sample_s={t1 - t0:.1f} score_s={time.perf_counter() - t1:.1f}"
    )
    getattr(engine, "close", lambda: None)()


if __name__ == "__main__":
    main()
