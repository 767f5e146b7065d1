"""Advantage estimators against hand-computed cases and plain-Python loop references (CPU)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlpost.algos import (
    ADVANTAGES,
    get_advantage_estimator,
    masked_whiten,
    scores_to_token_rewards,
)
from rlpost.registry import UnknownNameError

OUTCOME = ("grpo", "dr_grpo", "rloo", "gpg", "reinforce_pp_baseline")


def outcome_batch(scores, lengths, width=5, dtype=torch.float32):
    """Rewards with each score on the last valid token; mask from lengths."""
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    return scores_to_token_rewards(torch.tensor(scores, dtype=dtype), mask), mask


def loop_group_stats(scores, groups):
    """(mean, unbiased std, size) per row from plain Python, verl singleton rule."""
    members = {}
    for s, g in zip(scores, groups, strict=True):
        members.setdefault(g, []).append(s)
    out = []
    for g in groups:
        vals = members[g]
        if len(vals) == 1:
            out.append((0.0, 1.0, 1))
        else:
            out.append((statistics.fmean(vals), statistics.stdev(vals), len(vals)))
    return out


def loop_whiten(rows, masks):
    vals = [x for row, m in zip(rows, masks, strict=True) for x, k in zip(row, m, strict=True) if k]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [
        [(x - mu) * scale if k else 0.0 for x, k in zip(row, m, strict=True)]
        for row, m in zip(rows, masks, strict=True)
    ]


def test_grpo_hand_computed():
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 2.0, 4.0], [3, 2, 4, 1, 5])
    group = torch.tensor([11, 11, 11, 4, 4])
    adv, ret = get_advantage_estimator("grpo")(rewards, mask, group)
    # group 11: mean 2/3, unbiased std sqrt(1/3); group 4: mean 3, std sqrt(2)
    expected_rows = [
        (1 / 3) / (math.sqrt(1 / 3) + 1e-6),
        (-2 / 3) / (math.sqrt(1 / 3) + 1e-6),
        (1 / 3) / (math.sqrt(1 / 3) + 1e-6),
        -1 / (math.sqrt(2) + 1e-6),
        1 / (math.sqrt(2) + 1e-6),
    ]
    expected = torch.tensor(expected_rows)[:, None] * mask
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ret, adv)
    assert adv.dtype == torch.float32


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gpg"])
def test_loop_versus_vectorised(name):
    gen = torch.Generator().manual_seed(0)
    groups = [3, 9, 3, 1, 9, 3, 9, 42, 1, 9]
    scores = torch.randint(0, 4, (len(groups),), generator=gen).float() * 0.5
    scores[3] = 7.0
    rewards, mask = outcome_batch(scores.tolist(), [5, 2, 3, 4, 1, 5, 5, 2, 3, 4])
    adv, _ = get_advantage_estimator(name)(rewards, mask, torch.tensor(groups))
    stats = loop_group_stats(scores.tolist(), groups)
    nonzero = max(1, sum(1 for s in scores.tolist() if s != 0))
    expected = []
    for s, (mu, sd, n) in zip(scores.tolist(), stats, strict=True):
        if name == "grpo":
            expected.append((s - mu) / (sd + 1e-6))
        elif name == "dr_grpo":
            expected.append(s - mu)
        elif name == "rloo":
            expected.append(s if n == 1 else n / (n - 1) * (s - mu))
        else:
            expected.append(len(groups) / nonzero * (s - mu))
    torch.testing.assert_close(adv, torch.tensor(expected)[:, None] * mask, rtol=1e-5, atol=1e-6)


def test_rloo_is_leave_one_out_mean():
    rewards, mask = outcome_batch([1.0, 3.0, 8.0], [2, 2, 2])
    adv, _ = get_advantage_estimator("rloo")(rewards, mask, torch.tensor([0, 0, 0]))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 - 5.5, 3 - 4.5, 8 - 2.0]))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_sum_to_zero(name):
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(12, generator=gen)
    rewards, mask = outcome_batch(scores.tolist(), [5] * 12)
    group = torch.tensor([0, 1, 2] * 4)
    adv, _ = get_advantage_estimator(name)(rewards, mask, group)
    for g in range(3):
        assert abs(float(adv[group == g, 0].sum())) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", OUTCOME)
def test_all_equal_rewards_give_exact_zero(name, dtype):
    # In float64, 0.1 * 3 / 3 != 0.1: a naive mean leaves a 1e-17 residue that eps would blow up.
    rewards, mask = outcome_batch([0.1] * 6, [5, 3, 1, 2, 4, 5], dtype=dtype)
    group = torch.tensor([7, 7, 7, 2, 2, 2])
    adv, ret = get_advantage_estimator(name)(rewards, mask, group)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert not torch.isnan(ret).any()


def test_singleton_groups_keep_raw_score():
    rewards, mask = outcome_batch([2.5, 1.0, 0.0], [2, 3, 3])
    group = torch.tensor([5, 8, 8])
    grpo, _ = get_advantage_estimator("grpo")(rewards, mask, group)
    rloo, _ = get_advantage_estimator("rloo")(rewards, mask, group)
    dr, _ = get_advantage_estimator("dr_grpo")(rewards, mask, group)
    assert grpo[0, 0].item() == pytest.approx(2.5 / (1 + 1e-6), rel=1e-7)
    assert rloo[0, 0].item() == 2.5
    assert dr[0, 0].item() == 2.5
    assert torch.equal(grpo[0, 2:], torch.zeros(3))


@pytest.mark.parametrize("name", OUTCOME)
def test_group_ids_are_order_free(name):
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(8, generator=gen)
    rewards, mask = outcome_batch(scores.tolist(), [5, 4, 3, 2, 5, 4, 3, 2])
    group = torch.tensor([100, 3, 100, 3, 55, 55, 3, 100])
    perm = torch.randperm(8, generator=gen)
    adv, _ = get_advantage_estimator(name)(rewards, mask, group)
    adv_perm, _ = get_advantage_estimator(name)(rewards[perm], mask[perm], group[perm])
    torch.testing.assert_close(adv_perm, adv[perm], rtol=1e-5, atol=1e-6)


def test_outcome_score_sums_all_token_rewards():
    mask = torch.ones(2, 3)
    spread = torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]])
    last = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    group = torch.tensor([0, 0])
    a, _ = get_advantage_estimator("dr_grpo")(spread, mask, group)
    b, _ = get_advantage_estimator("dr_grpo")(last, mask, group)
    torch.testing.assert_close(a, b)


def loop_reinforce_returns(rewards, masks, gamma):
    out = []
    for row, m in zip(rewards, masks, strict=True):
        running, ret = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if m[t]:
                running = row[t] + gamma * running
                ret[t] = running
        out.append(ret)
    return out


def test_reinforce_pp_hand_and_holes():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    adv, ret = get_advantage_estimator("reinforce_pp")(
        rewards, mask, torch.tensor([0, 1]), gamma=0.5
    )
    # Masked token 1 of row 2 is skipped: no reward, no extra discount.
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [0.5, 0.0, 1.0]]))
    expected = loop_whiten(ret.tolist(), mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_loop_equivalence():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    adv, ret = get_advantage_estimator("reinforce_pp")(rewards, mask, torch.arange(4), gamma=0.9)
    ref = loop_reinforce_returns(rewards.tolist(), mask.tolist(), 0.9)
    torch.testing.assert_close(ret, torch.tensor(ref), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        adv, torch.tensor(loop_whiten(ref, mask.tolist())), rtol=1e-4, atol=1e-5
    )


def test_reinforce_pp_baseline_matches_loop():
    rewards, mask = outcome_batch([1.0, 0.0, 0.0, 1.0, 3.0], [2, 3, 1, 4, 5])
    group = torch.tensor([0, 0, 1, 1, 2])
    adv, ret = get_advantage_estimator("reinforce_pp_baseline")(rewards, mask, group)
    centered = [0.5, -0.5, -0.5, 0.5, 3.0]  # singleton group 2 keeps its score
    rows = [[c] * 5 for c in centered]
    expected = loop_whiten(rows, mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, adv)


def loop_gae(rewards, values, masks, gamma, lams):
    """Plain GAE on each row's valid tokens only, scattered back (carried through holes)."""
    out = []
    for row, vals, m, lam in zip(rewards, values, masks, lams, strict=True):
        idx = [t for t in range(len(row)) if m[t]]
        adv_valid, next_v, next_a = {}, 0.0, 0.0
        for t in reversed(idx):
            delta = row[t] + gamma * next_v - vals[t]
            next_a = delta + gamma * lam * next_a
            next_v = vals[t]
            adv_valid[t] = next_a
        out.append([adv_valid.get(t, 0.0) for t in range(len(row))])
    return out


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    adv_raw = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, [1.0])
    assert adv_raw == [[0.5, 0.5, 0.5]]
    _, ret = get_advantage_estimator("gae")(rewards, mask, torch.tensor([0]), values=values)
    torch.testing.assert_close(ret, torch.ones(1, 3))


def test_gae_loop_equivalence_with_holes():
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(3, 8, generator=gen)
    values = torch.randn(3, 8, generator=gen)
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]]
    ).float()
    adv, ret = get_advantage_estimator("gae")(
        rewards, mask, torch.arange(3), values=values, gamma=0.9, lam=0.8
    )
    raw = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, [0.8] * 3)
    expected_ret = [
        [(a + v) if k else 0.0 for a, v, k in zip(ra, rv, rm, strict=True)]
        for ra, rv, rm in zip(raw, values.tolist(), mask.tolist(), strict=True)
    ]
    torch.testing.assert_close(ret, torch.tensor(expected_ret), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        adv, torch.tensor(loop_whiten(raw, mask.tolist())), rtol=1e-4, atol=1e-5
    )


def test_gae_ignores_garbage_on_padding():
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(2, 6, generator=gen)
    values = torch.randn(2, 6, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]).float()
    base = get_advantage_estimator("gae")(rewards, mask, torch.arange(2), values=values, lam=0.9)
    junk_r, junk_v = rewards.clone(), values.clone()
    junk_r[0, 4:], junk_v[0, 4:] = 1e6, -1e6
    noisy = get_advantage_estimator("gae")(junk_r, mask, torch.arange(2), values=junk_v, lam=0.9)
    for a, b in zip(base, noisy, strict=True):
        torch.testing.assert_close(a, b)


def test_vapo_gae_length_adaptive_lambda():
    gen = torch.Generator().manual_seed(6)
    width = 40
    lengths = [40, 10, 25]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    rewards = torch.randn(3, width, generator=gen) * 0.1
    values = torch.randn(3, width, generator=gen)
    adv, ret = get_advantage_estimator("vapo_gae")(
        rewards, mask, torch.arange(3), values=values, gamma=1.0, alpha=0.05, value_lam=1.0
    )
    # lam = 1 - 1/(0.05 n): n=40 -> 0.5, n=10 -> -1 clamped to 0, n=25 -> 0.2
    lams = [0.5, 0.0, 0.2]
    raw = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, lams)
    torch.testing.assert_close(
        adv, torch.tensor(loop_whiten(raw, mask.tolist())), rtol=1e-4, atol=1e-5
    )
    critic = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, [1.0] * 3)
    expected_ret = [
        [(a + v) if k else 0.0 for a, v, k in zip(ra, rv, rm, strict=True)]
        for ra, rv, rm in zip(critic, values.tolist(), mask.tolist(), strict=True)
    ]
    torch.testing.assert_close(ret, torch.tensor(expected_ret), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gae", "vapo_gae"])
def test_critic_estimators_need_values(name):
    with pytest.raises(ValueError, match="needs values"):
        get_advantage_estimator(name)(torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0]))


def test_input_validation():
    est = get_advantage_estimator("grpo")
    with pytest.raises(ValueError, match="integer prompt ids"):
        est(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="response_mask shape"):
        est(torch.zeros(2, 3), torch.ones(2, 4), torch.tensor([0, 1]))
    with pytest.raises(TypeError):
        est(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([0, 1]), gamma=0.9)
    with pytest.raises(UnknownNameError, match=r"valid: .*grpo"):
        get_advantage_estimator("grpoo")


def extra_inputs(name, batch, width):
    """The caller-supplied inputs an estimator's traits ask for, with gradients on."""
    out = {}
    if ADVANTAGES.trait(name, "needs_components"):
        out["components"] = torch.rand(batch, 2, requires_grad=True)
    if ADVANTAGES.trait(name, "needs_greedy_baseline"):
        out["baseline_scores"] = torch.rand(batch, requires_grad=True)
    if ADVANTAGES.trait(name, "needs_teacher"):
        out["old_logprobs"] = (-torch.rand(batch, width)).requires_grad_(True)
        out["teacher_logprobs"] = (-torch.rand(batch, width)).requires_grad_(True)
    if ADVANTAGES.trait(name, "needs_sum_pi_squared"):
        out["old_logprobs"] = (-torch.rand(batch, width)).requires_grad_(True)
        out["sum_pi_squared"] = torch.rand(batch, width, requires_grad=True)
    return out


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_no_gradient_and_zero_padding(name):
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 1.0], [5, 2, 3, 4])
    rewards.requires_grad_(True)
    values = torch.randn(4, 5, requires_grad=True)
    adv, ret = get_advantage_estimator(name)(
        rewards, mask, torch.tensor([0, 0, 1, 1]), values=values, **extra_inputs(name, 4, 5)
    )
    assert not adv.requires_grad and not ret.requires_grad
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


def test_scores_to_token_rewards():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = scores_to_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    # the fully masked row keeps its score at position 0, where no loss reads it
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [5.0, 0.0, 0.0]]))


@pytest.mark.parametrize("name", OUTCOME)
def test_masked_row_keeps_its_score_in_group_statistics(name):
    # Row 3 has no trainable token (e.g. its reward was dropped): its score still enters
    # the group's mean, std and leave-one-out baseline, and its advantage is zero.
    scores, groups = [1.0, 0.0, 1.0, 0.5], torch.tensor([0, 0, 0, 0])
    full, full_mask = outcome_batch(scores, [3, 3, 3, 3])
    masked, mask = outcome_batch(scores, [3, 3, 3, 0])
    fn = get_advantage_estimator(name)
    want, _ = fn(full, full_mask, groups)
    got, _ = fn(masked, mask, groups)
    if name == "reinforce_pp_baseline":  # whitening runs over the valid tokens only
        centered = torch.tensor(scores, dtype=torch.float64) - sum(scores) / 4
        want = masked_whiten(centered[:, None].expand(4, 5), mask.to(torch.float64))
        want = want.float() * mask
    torch.testing.assert_close(got[:3], want[:3])
    assert torch.equal(got[3], torch.zeros(5))


def test_grpo_batch_std():
    scores, groups = [1.0, 0.0, 3.0, 3.0, 2.0, 6.0], torch.tensor([0, 0, 0, 1, 1, 1])
    rewards, mask = outcome_batch(scores, [2] * 6)
    adv, _ = get_advantage_estimator("grpo")(rewards, mask, groups, std_scope="batch", eps=0.0)
    batch_std = statistics.stdev(scores)
    means = [4 / 3] * 3 + [11 / 3] * 3
    want = [(s - m) / batch_std for s, m in zip(scores, means, strict=True)]
    torch.testing.assert_close(adv[:, 0], torch.tensor(want))
    with pytest.raises(ValueError, match="std_scope"):
        get_advantage_estimator("grpo")(rewards, mask, groups, std_scope="global")
