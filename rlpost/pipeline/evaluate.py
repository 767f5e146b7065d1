"""Held-out evaluation and the per-step health numbers that catch silent failure."""

from __future__ import annotations

import math

import torch

from rlpost.algos import group_zero_spread_fraction
from rlpost.rewards.scorer import RewardScorer
from rlpost.rollout.protocol import SamplingParams
from rlpost.types import Completion, Prompt, RewardSample


def to_reward_samples(
    prompts: list[Prompt], completions: list[Completion], n: int, max_tokens: int
) -> list[RewardSample]:
    """Completion ``i`` answers ``prompts[i // n]``."""
    return [
        RewardSample(
            prompt=prompts[i // n].text,
            completion=c.text,
            answer=prompts[i // n].answer,
            metadata=prompts[i // n].metadata,
            finish_reason=c.finish_reason,
            num_tokens=len(c.token_ids),
            max_tokens=max_tokens,
        )
        for i, c in enumerate(completions)
    ]


def evaluate(
    engine,
    tokenizer,
    prompts: list[Prompt],
    scorer: RewardScorer,
    params: SamplingParams,
    chunk: int = 256,
) -> dict[str, float]:
    """Accuracy (fraction of completions whose score is > 0.5) and mean score on ``prompts``."""
    if not prompts:
        return {}
    scores: list[float] = []
    lengths: list[int] = []
    for lo in range(0, len(prompts), chunk):
        part = prompts[lo : lo + chunk]
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in part]
        completions = engine.generate(ids, params, n=1)
        samples = to_reward_samples(part, completions, 1, params.max_tokens)
        scores.extend(scorer.score(samples).scores)
        lengths.extend(len(c.token_ids) for c in completions)
    return {
        "eval_accuracy": sum(s > 0.5 for s in scores) / len(scores),
        "eval_reward_mean": sum(scores) / len(scores),
        "eval_response_length": sum(lengths) / len(lengths),
        "eval_problems": float(len(scores)),
    }


def rollout_health(
    completions: list[Completion], scores: torch.Tensor, group: torch.Tensor
) -> dict[str, float]:
    """Truncated fraction, zero-spread group fraction, reward stats, response length."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    return {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_frac": sum(c.truncated for c in completions) / len(completions),
        "zero_spread_frac": float(group_zero_spread_fraction(scores, group)),
    }


def logprob_gap(engine_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |engine - trainer| logprob over the same tokens (a sync / precision check)."""
    n = float(mask.sum())
    if n == 0:
        return 0.0
    gap = float(((engine_lp - trainer_lp).abs() * mask).sum() / n)
    return gap if math.isfinite(gap) else float("nan")
