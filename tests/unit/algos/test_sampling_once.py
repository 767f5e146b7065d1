"""The overlong penalty and the dynamic-sampling filter are each one function, and every
caller gives its answer at the edges (CPU): the length window's start, ``max_len`` itself,
beyond it, a hard cliff; flat, singleton, NaN and spread groups."""

from __future__ import annotations

import pytest
import torch

from rlpost.algos import group_has_spread, groups_with_spread, overlong_penalty
from rlpost.pipeline.stages import RolloutSettings, rollout_stage
from rlpost.rewards.rule import overlong_penalty as overlong_reward
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.worker import RolloutResult
from rlpost.types import Completion, Group, Prompt, RewardSample

# (max_len, cache_len, length, penalty): hand-computed from DAPO eq. 13
EDGES = [
    (10, 4, 6, 0.0),  # exactly at the window's start: free
    (10, 4, 7, -0.25),  # one token into the window
    (10, 4, 10, -1.0),  # exactly at max_len: the ramp's end
    (10, 4, 11, -1.0),  # beyond max_len
    (10, 4, 400, -1.0),
    (10, 0, 10, 0.0),  # hard cliff: max_len itself is free
    (10, 0, 11, -1.0),
    (10, 10, 0, 0.0),  # the window is the whole budget
    (10, 10, 5, -0.5),
]


@pytest.mark.parametrize(("max_len", "cache_len", "length", "want"), EDGES)
def test_overlong_edges_are_the_same_for_the_tensor_and_the_reward(
    max_len, cache_len, length, want
):
    tensor = overlong_penalty(torch.tensor([length]), max_len, cache_len)
    assert tensor.tolist() == [want]  # all exact in binary
    sample = RewardSample("q", "", num_tokens=length, max_tokens=max_len)
    assert overlong_reward(sample, cache_len=cache_len) == want


def test_the_reward_refuses_what_the_tensor_refuses():
    with pytest.raises(ValueError, match="cache_len=11, max_len=10"):
        overlong_penalty(torch.tensor([3]), 10, 11)
    with pytest.raises(ValueError, match=r"^overlong_penalty: .*cache_len=11, max_len=10"):
        overlong_reward(RewardSample("q", "", num_tokens=3, max_tokens=10), cache_len=11)


def test_the_reward_keeps_python_float_precision():
    sample = RewardSample("q", "", num_tokens=8, max_tokens=10)
    assert overlong_reward(sample, cache_len=3) == (7 - 8) / 3  # float64, as before


class Rollout:
    """One group per prompt, ``n`` completions; the prompt's text picks its scores."""

    def generate(self, prompts, params, n, *, train=False, last=False):
        comp = [Completion([1], [5], [-0.5], "stop", 0, i) for i in range(len(prompts))]
        return RolloutResult([Group(p, [comp[i]] * n) for i, p in enumerate(prompts)])


SCORES = {"flat": [1.0, 1.0], "spread": [0.0, 1.0], "nan": [float("nan"), 1.0], "tiny": [0.0, 1e-9]}


class Reward:
    def score(self, groups, max_tokens=None, *, training=True):
        return [Group(g.prompt, g.completions, SCORES[g.prompt.text], {}) for g in groups]


class Sampler:
    def next_batch(self):
        return [Prompt(t) for t in SCORES]


def test_the_rollout_stage_keeps_exactly_the_groups_the_filter_keeps():
    s = RolloutSettings(n=2, prompts_per_step=4, dynamic_sampling=True, max_sampling_rounds=1)
    out = rollout_stage(Rollout(), Reward(), Sampler(), SamplingParams(), s)
    kept = [g.prompt.text for g in out.groups]
    scores = torch.tensor([x for v in SCORES.values() for x in v], dtype=torch.float64)
    ids = torch.arange(len(SCORES)).repeat_interleave(2)
    want = [t for t, ok in zip(SCORES, group_has_spread(scores, ids).tolist(), strict=True) if ok]
    assert kept == want == ["spread", "tiny"]  # flat and NaN groups have no spread
    assert (
        groups_with_spread(scores, ids).tolist()
        == [False, False, True, True] + [False] * 2 + [True] * 2
    )
