"""Micro-batches cut by a token budget: every row once, within the budget, trimmed to their
own widths, and the same update and scoring-pass logprobs as micro-batches of rows."""

from __future__ import annotations

import copy

import pytest
import torch

from rlpost.algos import (
    get_advantage_estimator,
    get_kl_estimator,
    scores_to_token_rewards,
)
from rlpost.config import OptimConfig
from rlpost.params import PPOClipParams
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.batch import collate, compute_logprobs, pad_responses
from rlpost.train.optim import budget_slices
from rlpost.types import Completion


def _batch(vocab: int):
    """16 rows, 4 groups, prompts of 2-9 tokens and responses of 1-12 (one long row)."""
    gen = torch.Generator().manual_seed(4)
    rows = []
    for i in range(16):
        p_len = 2 + int(torch.randint(0, 8, (1,), generator=gen))
        r_len = 12 if i == 5 else 1 + int(torch.randint(0, 4, (1,), generator=gen))
        prompt = torch.randint(4, vocab, (p_len,), generator=gen).tolist()
        response = torch.randint(4, vocab, (r_len,), generator=gen).tolist()
        rows.append(Completion(prompt, response, [-1.0] * r_len, "stop", 0, i // 4))
    b = collate(rows, [float(i % 3 == 0) for i in range(16)], 0)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


def test_budget_slices_cover_every_row_within_the_budget():
    prompt = torch.tensor([3, 9, 2, 2, 5, 4, 2, 8])
    response = torch.tensor([1, 20, 2, 3, 1, 2, 2, 1])
    slices = budget_slices(torch.arange(8), prompt, response, 3, 24)
    assert sorted(torch.cat(slices).tolist()) == list(range(8))
    assert slices[0].tolist() == [1]  # 29 tokens: over the budget, alone
    for s in slices:
        assert len(s) <= 3
        width = int(prompt[s].max() + response[s].max())
        assert len(s) == 1 or len(s) * width <= 24
    assert budget_slices(torch.arange(8), prompt, response, 3, 0)[0].tolist() == [0, 1, 2]


def test_trimmed_micro_batch_has_its_own_widths_and_the_same_logprobs(tiny):
    model, tok = tiny
    b = _batch(len(tok))
    short = b.select(torch.tensor([0, 1, 2]))
    trimmed = short.trimmed()
    P, T = b.prompt_width, b.responses.shape[1]
    assert trimmed.responses.shape[1] < T and trimmed.input_ids.shape[1] < P + T
    assert torch.equal(trimmed.attention_mask.sum(-1), short.attention_mask.sum(-1))
    full = compute_logprobs(model, short, temperature=1.0, micro_batch_size=3)
    mine = pad_responses(compute_logprobs(model, trimmed, temperature=1.0, micro_batch_size=3), T)
    mask = short.response_mask.bool()
    torch.testing.assert_close(mine[mask], full[mask], atol=1e-5, rtol=1e-5)
    budget = compute_logprobs(model, b, temperature=1.0, micro_batch_size=4, max_tokens=40)
    padded = compute_logprobs(model, b, temperature=1.0, micro_batch_size=4)
    mask = b.response_mask.bool()
    torch.testing.assert_close(budget[mask], padded[mask], atol=1e-5, rtol=1e-5)


def _trainer(model, budget: int, entropy: float = 0.0):
    s = ActorSettings(
        optim=OptimConfig(lr=1e-3),
        mini_batch_size=8,
        micro_batch_size=4,
        max_tokens_per_micro_batch=budget,
        entropy_coef=entropy,
    )
    return PolicyTrainer(model, PPOClipParams(), s, kl_estimator=get_kl_estimator("k3"))


@pytest.mark.parametrize("budget", [30, 64])
def test_token_budget_update_equals_the_padded_update(tiny, budget):
    """Two optimizer steps (mini-batches of 8): the same losses and weights as micro-batches
    of 4 rows at the batch's widths, whatever the budget."""
    model, tok = tiny
    b = _batch(len(tok))
    a, c = copy.deepcopy(model), copy.deepcopy(model)
    ta, tc = _trainer(a, budget, 0.01), _trainer(c, 0, 0.01)
    b1, b2 = copy.deepcopy(b), copy.deepcopy(b)
    b1.old_logprobs, b2.old_logprobs = ta.old_logprobs(b1), tc.old_logprobs(b2)
    mask = b.response_mask.bool()
    torch.testing.assert_close(b1.old_logprobs[mask], b2.old_logprobs[mask], atol=1e-5, rtol=0)
    s1, s2 = ta.update(b1).stats, tc.update(b2).stats
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)
    assert s1["entropy"] == pytest.approx(s2["entropy"], abs=1e-5)
    moved = max(
        (p - q).abs().max() for p, q in zip(a.parameters(), model.parameters(), strict=True)
    )
    assert moved > 1e-4
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_on_policy_fill_of_old_logprobs_under_a_budget(tiny):
    model, tok = tiny
    b = _batch(len(tok))
    s = ActorSettings(
        optim=OptimConfig(lr=1e-3),
        mini_batch_size=16,
        micro_batch_size=4,
        max_tokens_per_micro_batch=30,
    )
    tr = PolicyTrainer(copy.deepcopy(model), PPOClipParams(), s)
    explicit = tr.old_logprobs(b)
    b.old_logprobs = None
    filled = tr.update(b).old_logprobs  # returned, never written into the batch
    mask = b.response_mask.bool()
    assert b.old_logprobs is None and filled.shape == b.response_mask.shape
    torch.testing.assert_close(filled[mask], explicit[mask], atol=1e-5, rtol=0)
