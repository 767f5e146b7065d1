"""GRPO written against rlpost's Python API: sample, score, advantages, one step.

The loop is the user's; every computation is rlpost's (the engine, the registered GRPO
estimator, the trainer's ppo_clip loss and AdamW). It starts from the default job's
supervised warm-up of the built-in tiny model (``rlpost.train`` with no RL steps), then runs
``--steps`` GRPO steps on two-operand arithmetic and prints held-out accuracy before and
after, as JSON on its last line.

    python examples/api_grpo_loop.py --steps 20 --out runs/api_loop
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

import rlpost
from rlpost.algos.advantages import ADVANTAGES
from rlpost.data.arith import arith_splits
from rlpost.rewards.verifiable import numeric_match
from rlpost.types import RewardSample


def score(text: str, answer: int) -> float:
    return numeric_match(RewardSample(prompt="", completion=text, answer=answer)) or 0.0


def accuracy(sampler, tok, problems, params, n: int) -> float:
    """Mean reward of ``n`` samples of each held-out problem."""
    out = sampler.sample([tok.encode(p.text) for p in problems], params, n=n)
    rewards = [score(tok.decode(c.token_ids), problems[i // n].answer) for i, c in enumerate(out)]
    return sum(rewards) / len(rewards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64, help="problems per step")
    ap.add_argument("--n", type=int, default=8, help="samples per problem (the GRPO group)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--eval", type=int, default=300, help="held-out problems")
    ap.add_argument("--out", default="runs/api_loop")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the tiny model is overhead-bound

    # The default job's warm-up (its recipe, no RL steps) gives the starting policy.
    warm = Path(args.out) / "warmup" / "sft_model"
    if not warm.is_dir():
        rlpost.train("grpo_arith", ["train.steps=0", "eval.every=0", "eval.limit=1",
                                    "observe.plot=false", f"run.output_dir={args.out}",
                                    "run.name=warmup", "run.overwrite=true"])  # fmt: skip

    base = rlpost.Base.load(warm)
    tok = base.tokenizer
    policy = base.policy(lora=None, lr=args.lr)  # full fine-tuning, as the default job
    train, held_out = arith_splits(30, ["+", "-"], train_size=20000, eval_size=args.eval)
    sampling = rlpost.SamplingParams(max_tokens=6, stop_token_ids=(tok.eos_token_id,))
    evaluation = rlpost.SamplingParams(max_tokens=6, stop_token_ids=(tok.eos_token_id,), seed=7)
    before = accuracy(policy, tok, held_out, evaluation, n=4)
    grpo, rng = ADVANTAGES.get("grpo"), random.Random(0)

    for step in range(args.steps):
        problems = rng.sample(train, args.prompts)
        prompts = [tok.encode(p.text) for p in problems]
        out = policy.sample(prompts, sampling, n=args.n)
        rewards = torch.tensor(
            [
                score(tok.decode(c.token_ids), problems[i // args.n].answer)
                for i, c in enumerate(out)
            ]
        )
        group = torch.arange(len(out)) // args.n
        # One reward per sequence at its last token: the estimator's input layout.
        advantages, _ = grpo(rewards[:, None], torch.ones(len(out), 1), group)
        data = []
        for i, c in enumerate(out):
            seq, p = prompts[i // args.n] + c.token_ids, len(prompts[i // args.n]) - 1
            t, a = len(c.token_ids), float(advantages[i, 0])
            data.append(rlpost.Datum(
                seq[:-1], seq[1:], [0.0] * p + [1.0] * t,
                {"logprobs": [0.0] * p + c.logprobs, "advantages": [0.0] * p + [a] * t},
            ))  # fmt: skip
        fb = policy.forward_backward(data, "ppo_clip")
        stats = policy.optim_step(lr=args.lr, betas=(0.9, 0.999), grad_clip=1.0)
        print(f"step {step + 1}/{args.steps}: reward {rewards.mean():.3f} loss {fb.loss:.4f} "
              f"grad_norm {stats['grad_norm']:.3f}", flush=True)  # fmt: skip

    after = accuracy(policy, tok, held_out, evaluation, n=4)
    print(f"held-out accuracy: {before:.1%} -> {after:.1%}")
    print(json.dumps({"before": before, "after": after, "steps": args.steps}))


if __name__ == "__main__":
    main()
