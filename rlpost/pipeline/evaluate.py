"""Held-out evaluation and the per-step health numbers that catch silent failure."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from rlpost.algos import group_zero_spread_fraction
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.types import Completion, Group, Prompt


def evaluate(
    rollout,
    reward,
    prompts: list[Prompt],
    params: SamplingParams,
    chunk: int = 256,
    samples: int = 1,
    progress=None,
) -> dict[str, float]:
    """Accuracy (score > 0.5) over ``samples`` completions per problem, its standard error
    over problems, and the mean score on ``prompts``."""
    if not prompts:
        return {}
    k = 1 if params.temperature == 0 else samples
    groups = sample_groups(rollout, reward, prompts, params, k, chunk, progress)
    # a prompt whose samples were dropped counts as wrong: over every problem, not what came back
    per_problem = [sum(s > 0.5 for s in g.scores) / k for g in groups]
    per_problem += [0.0] * max(0, len(prompts) - len(groups))
    scores = [s for g in groups for s in g.scores]
    lengths = [len(c.token_ids) for g in groups for c in g.completions]
    episodes = [c.episode for g in groups for c in g.completions if c.episode is not None]
    accuracy = sum(per_problem) / len(per_problem)
    var = sum((a - accuracy) ** 2 for a in per_problem) / max(1, len(per_problem) - 1)
    return {
        "eval_accuracy": accuracy,
        "eval_accuracy_stderr": math.sqrt(var / len(per_problem)),
        "eval_reward_mean": sum(scores) / len(scores) if scores else 0.0,
        "eval_response_length": sum(lengths) / len(lengths) if lengths else 0.0,
        "eval_problems": float(len(per_problem)),
        "eval_dropped": float(len(prompts) * k - len(scores)),
        **episode_summary(episodes),
    }


def eval_label(problems: int, samples: int, temperature: float, sets: int = 0) -> str:
    """What a held-out evaluation is doing, in words (its progress bar's name)."""
    if sets:
        return f"held-out evaluation: {problems} problems in {sets} sets"
    if temperature == 0:
        return f"held-out evaluation: {problems} problems, greedy"
    return f"held-out evaluation: {problems} problems x {samples} samples at T={temperature:g}"


def sample_groups(
    rollout,
    reward,
    prompts: list[Prompt],
    params: SamplingParams,
    k: int,
    chunk: int = 256,
    progress=None,
) -> list[Group]:
    """``k`` scored samples of every prompt, generated ``chunk`` sequences at a time."""
    out: list[Group] = []
    per_chunk = max(1, chunk // k)
    if progress is not None:
        progress.grow(len(prompts) * k)
    for lo in range(0, len(prompts), per_chunk):
        # Each chunk its own seed, or every chunk would replay the same random stream.
        call = params if params.seed is None else replace(params, seed=params.seed + lo)
        part = prompts[lo : lo + per_chunk]
        generated = rollout.generate(part, call, k).groups
        out += reward.score(generated, params.max_tokens, training=False)
        if progress is not None:
            progress.advance(len(part) * k)
    return out


def episode_summary(episodes: list) -> dict[str, float]:
    """Held-out tool use of multi-turn episodes: the fraction that called a tool at least
    once, calls and policy turns per episode ({} for single-turn completions)."""
    if not episodes:
        return {}
    e = len(episodes)
    return {
        "eval_tool_call_rate": sum(ep.tool_calls > 0 for ep in episodes) / e,
        "eval_tool_calls_mean": sum(ep.tool_calls for ep in episodes) / e,
        "eval_turns_mean": sum(ep.policy_turns for ep in episodes) / e,
    }


def rollout_health(
    completions: list[Completion], scores: torch.Tensor, group: torch.Tensor
) -> dict[str, float]:
    """Truncated fraction, zero-spread group fraction, reward stats, response length."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    return {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward_min": float(scores.min()) if len(scores) else math.nan,
        "reward_max": float(scores.max()) if len(scores) else math.nan,
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
