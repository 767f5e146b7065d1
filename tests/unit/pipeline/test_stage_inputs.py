"""The rollout stage's greedy baselines (ReMax) and the inputs the train stage hands to
estimators whose traits ask for them (CPU, fake workers)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rlpost.config import AlgoConfig, load_config
from rlpost.pipeline.stages import (
    RolloutSettings,
    collate_groups,
    compute_advantages,
    estimator_inputs,
    rollout_stage,
)
from rlpost.resolved import resolve_step_plan
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.worker import RolloutResult
from rlpost.types import Completion, Group, Prompt


def completion(tokens, group=0):
    return Completion([1, 2], tokens, [-0.5] * len(tokens), "stop", 0, group)


class FakeRollout:
    """Answers ``n`` samples per prompt; greedy calls answer with one token [9]."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, n, *, train=False, last=False):
        self.calls.append((params.temperature, n, train))
        tokens = [9] if params.temperature == 0 else [5, 6]
        groups = [
            Group(p, [completion(tokens, i) for _ in range(n)]) for i, p in enumerate(prompts)
        ]
        return RolloutResult(groups)


class FakeReward:
    """Score = 1 for a greedy answer to prompt "a", 0.5 for a sampled one."""

    def score(self, groups, max_tokens=None, *, training=True):
        out = []
        for g in groups:
            s = [
                (1.0 if g.prompt.text == "a" else 0.0) if c.token_ids == [9] else 0.5
                for c in g.completions
            ]
            out.append(Group(g.prompt, g.completions, s, {"t": s}, [False] * g.n))
        return out


class Sampler:
    def next_batch(self):
        return [Prompt("a"), Prompt("b")]


def test_greedy_baseline_is_one_greedy_sample_per_prompt():
    rollout = FakeRollout()
    s = RolloutSettings(n=3, prompts_per_step=2, greedy_baseline=True)
    out = rollout_stage(rollout, FakeReward(), Sampler(), SamplingParams(max_tokens=4), s)
    assert [g.baseline_score for g in out.groups] == [1.0, 0.0]
    assert rollout.calls == [(1.0, 3, True), (0.0, 1, False)]
    plain = rollout_stage(
        FakeRollout(), FakeReward(), Sampler(), SamplingParams(), RolloutSettings(3, 2)
    )
    assert [g.baseline_score for g in plain.groups] == [None, None]


class FakeTrainer:
    def logprobs(self, batch, which="old"):
        value = {"old": -0.5, "sum_pi_squared": 0.25}[which]
        return torch.full_like(batch.response_mask, value)


def scored_groups():
    g0 = Group(Prompt("a"), [completion([5, 6]), completion([7])], [1.0, 0.0], {"x": [1.0, 0.0]})
    g1 = Group(Prompt("b"), [completion([5]), completion([5, 6])], [0.0, 2.0], {"y": [0.0, 2.0]})
    g0.baseline_score, g1.baseline_score = 0.5, 1.0
    return [g0, g1]


def plan(estimator):
    return resolve_step_plan(load_config(None, [f"algo.advantage={estimator}"]))


def test_estimator_inputs_follow_the_traits():
    groups = scored_groups()
    batch = collate_groups(groups, pad_id=0)
    trainer = FakeTrainer()
    assert estimator_inputs(groups, batch, trainer, plan("grpo")) == {}
    comps = estimator_inputs(groups, batch, trainer, plan("gdpo"))["components"]
    want = torch.tensor([[1.0, math.nan], [0.0, math.nan], [math.nan, 0.0], [math.nan, 2.0]])
    torch.testing.assert_close(comps, want.double(), equal_nan=True)
    base = estimator_inputs(groups, batch, trainer, plan("remax"))["baseline_scores"]
    assert base.tolist() == [0.5, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="old logprobs up front"):
        estimator_inputs(groups, batch, trainer, plan("optimal_token_baseline"))
    with_old = replace(batch, old_logprobs=trainer.logprobs(batch, "old"))
    otb = estimator_inputs(groups, with_old, trainer, plan("optimal_token_baseline"))
    assert set(otb) == {"old_logprobs", "sum_pi_squared"} and batch.old_logprobs is None
    groups[1].baseline_score = None
    with pytest.raises(ValueError, match="greedy baselines"):
        estimator_inputs(groups, batch, trainer, plan("remax"))


def test_compute_advantages_passes_the_inputs():
    groups = scored_groups()
    batch = collate_groups(groups, pad_id=0)
    algo = AlgoConfig(advantage="remax", kl={"beta": 0.0})
    inputs = estimator_inputs(groups, batch, None, plan("remax"))
    adv = compute_advantages(batch, algo, beta=0.0, inputs=inputs)
    # score - greedy score on every valid token
    want = torch.tensor([[0.5, 0.5], [-0.5, 0.0], [-1.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(adv.advantages, want)
    assert batch.advantages is None  # returned, not written into the batch


def test_generated_tokens_count_every_round_and_the_greedy_answers():
    """rollout_tps is what the engine sampled: groups dynamic sampling dropped count too."""
    s = RolloutSettings(
        n=3, prompts_per_step=2, dynamic_sampling=True, max_sampling_rounds=3, greedy_baseline=True
    )
    out = rollout_stage(FakeRollout(), FakeReward(), Sampler(), SamplingParams(), s)
    assert out.rounds == 3  # every sampled group is flat (0.5 each): all three rounds ran
    assert out.generated == 3 * 2 * 3 * 2 + 2 * 1  # rounds x prompts x n x 2 tokens + greedy
