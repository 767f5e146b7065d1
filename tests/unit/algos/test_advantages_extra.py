"""OPO, Pass@k GRPO, GDPO, ReMax and the optimal token baseline: hand-computed cases,
plain-Python loop references, masked tokens and fully masked rows (CPU)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlpost.algos import ADVANTAGES, get_advantage_estimator, scores_to_token_rewards


def outcome_batch(scores, lengths, width=5):
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    return scores_to_token_rewards(torch.tensor(scores), mask), mask


def test_opo_hand_computed_with_masked_row_and_singleton():
    # group 0: lengths 2, 4, 1, 0 -> baseline (2*1 + 4*0 + 1*1 + 0*0) / 7; row 3 fully masked
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 0.0, 2.0], [2, 4, 1, 0, 3])
    adv, ret = get_advantage_estimator("opo")(rewards, mask, torch.tensor([0, 0, 0, 0, 1]))
    b = 3.0 / 7.0
    want = torch.tensor([1 - b, -b, 1 - b, 0.0, 2.0])[:, None] * mask
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, adv)


def test_opo_equal_lengths_is_the_group_mean_and_matches_loop():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (12,), generator=gen).float().tolist()
    lengths = torch.randint(1, 6, (12,), generator=gen).tolist()
    groups = [i % 3 for i in range(12)]
    rewards, mask = outcome_batch(scores, lengths)
    adv, _ = get_advantage_estimator("opo")(rewards, mask, torch.tensor(groups))
    for i in range(12):
        members = [j for j in range(12) if groups[j] == groups[i]]
        b = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        assert adv[i, 0].item() == pytest.approx(scores[i] - b, abs=1e-6)
    same, mask5 = outcome_batch(scores, [5] * 12)
    opo, _ = get_advantage_estimator("opo")(same, mask5, torch.tensor(groups))
    dr, _ = get_advantage_estimator("dr_grpo")(same, mask5, torch.tensor(groups))
    torch.testing.assert_close(opo, dr)


def test_grpo_passk_only_the_best_row_gets_the_margin():
    scores = [0.2, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.0]
    rewards, mask = outcome_batch(scores, [3, 2, 4, 1, 2, 2, 0, 3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, _ = get_advantage_estimator("grpo_passk")(rewards, mask, groups)
    margin = 0.5 / (statistics.stdev(scores[:4]) + 1e-6)
    want = torch.zeros(8)
    want[1] = margin  # group 1 ties for best: margin 0, every row 0
    torch.testing.assert_close(adv, want[:, None] * mask)
    raw, _ = get_advantage_estimator("grpo_passk")(rewards, mask, groups, norm_by_std=False)
    assert raw[1, 0].item() == pytest.approx(0.5) and raw.abs().sum().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2"):
        get_advantage_estimator("grpo_passk")(rewards[:5], mask[:5], groups[:5])


def loop_group_norm(values, groups, eps=1e-6):
    out = []
    for i, g in enumerate(groups):
        vals = [values[j] for j in range(len(groups)) if groups[j] == g]
        if len(vals) == 1:
            out.append(values[i] / (1.0 + eps))
        else:
            out.append((values[i] - statistics.fmean(vals)) / (statistics.stdev(vals) + eps))
    return out


def test_gdpo_normalises_each_term_then_whitens_the_batch():
    comps = [[1.0, 10.0], [0.0, 30.0], [1.0, float("nan")], [0.0, 0.0], [1.0, 50.0], [1.0, 20.0]]
    groups = [0, 0, 0, 1, 1, 1]
    lengths = [2, 3, 0, 1, 4, 2]  # row 2 fully masked: in the group statistics, no loss
    rewards, mask = outcome_batch(
        [sum(0 if math.isnan(x) else x for x in c) for c in comps], lengths
    )
    adv, _ = get_advantage_estimator("gdpo")(
        rewards, mask, torch.tensor(groups), components=torch.tensor(comps)
    )
    first = loop_group_norm([c[0] for c in comps], groups)
    second = loop_group_norm([0.0 if math.isnan(c[1]) else c[1] for c in comps], groups)
    total = [a + b for a, b in zip(first, second, strict=True)]
    valid = [(total[i], lengths[i]) for i in range(6)]
    vals = [t for t, n in valid for _ in range(n)]
    mu, sd = statistics.fmean(vals), math.sqrt(statistics.variance(vals) + 1e-8)
    want = torch.tensor([(t - mu) / sd for t in total])[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=1e-5, atol=1e-6)
    # one term and no components: GRPO's advantage, whitened over the batch
    alone, _ = get_advantage_estimator("gdpo")(rewards, mask, torch.tensor(groups))
    assert torch.isfinite(alone).all() and torch.equal(alone[2], torch.zeros(5))
    with pytest.raises(ValueError, match="components"):
        get_advantage_estimator("gdpo")(
            rewards, mask, torch.tensor(groups), components=torch.zeros(6)
        )


def test_remax_reward_to_go_minus_greedy_reward():
    rewards = torch.tensor([[0.5, 0.0, 1.0], [0.0, 1.0, 9.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = get_advantage_estimator("remax")(
        rewards, mask, torch.tensor([0, 1, 1]), baseline_scores=torch.tensor([1.0, 0.0, 4.0])
    )
    # the 9.0 on padding is no reward; the fully masked row gets nothing
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0] * 3]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0] * 3]))
    with pytest.raises(ValueError, match="baseline_scores"):
        get_advantage_estimator("remax")(rewards, mask, torch.tensor([0, 1, 1]))


def test_optimal_token_baseline_hand_computed():
    # row 0: pi = (0.5, 0.5), sum pi^2 = (0.5, 0.5) -> w = (0.5, 0.5), W = (0.5, 1.0)
    # row 1: pi = (0.25, 0.5), sum pi^2 = (0.25, 0.5) -> w = (0.75, 0.5), W = (0.75, 1.25)
    # row 2: fully masked, garbage inputs; row 3: alone in its group
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [7.0, 7.0], [0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.5], [0.9, 0.9], [0.5, 0.5]]))
    spsq = torch.tensor([[0.5, 0.5], [0.25, 0.5], [50.0, 50.0], [0.5, 0.5]])
    adv, ret = get_advantage_estimator("optimal_token_baseline")(
        rewards, mask, torch.tensor([0, 0, 0, 1]), old_logprobs=old, sum_pi_squared=spsq
    )
    b0, b1 = 0.5 / 1.25, 1.0 / 2.25
    want = torch.tensor([[1 - b0, 1 - b1], [-b0, -b1], [0.0, 0.0], [2.0, 2.0]])  # alone: A = G
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]))


def test_optimal_token_baseline_matches_loop():
    gen = torch.Generator().manual_seed(3)
    B, T = 8, 5
    lengths = [5, 3, 1, 4, 0, 2, 5, 3]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths])
    rewards = scores_to_token_rewards(torch.rand(B, generator=gen), mask)
    old = -torch.rand(B, T, generator=gen) * 2
    spsq = torch.rand(B, T, generator=gen) * 0.5 + 0.1
    groups = [0, 1, 0, 1, 0, 1, 0, 1]
    adv, _ = get_advantage_estimator("optimal_token_baseline")(
        rewards, mask, torch.tensor(groups), old_logprobs=old, sum_pi_squared=spsq
    )
    G, W = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for i in range(B):
        acc = 0.0
        for t in range(lengths[i]):
            acc += 1 - 2 * math.exp(old[i, t].item()) + spsq[i, t].item()
            W[i][t] = acc
            G[i][t] = sum(rewards[i, s].item() for s in range(t, lengths[i]))
    for i in range(B):
        for t in range(T):
            if t >= lengths[i]:
                assert adv[i, t].item() == 0.0
                continue
            members = [j for j in range(B) if groups[j] == groups[i] and t < lengths[j]]
            num = sum(G[j][t] * W[j][t] for j in members)
            den = sum(W[j][t] for j in members) + 1e-8
            baseline = num / den if len(members) > 1 else 0.0  # alone: no baseline (verl)
            assert adv[i, t].item() == pytest.approx(G[i][t] - baseline, abs=1e-5)


def test_traits_announce_the_extra_inputs():
    def having(trait: str) -> list[str]:
        return [n for n in ADVANTAGES.names() if ADVANTAGES.trait(n, trait)]

    assert having("needs_components") == ["gdpo"]
    assert having("needs_greedy_baseline") == ["remax"]
    assert having("needs_sum_pi_squared") == ["optimal_token_baseline"]
    for name in ("opo", "grpo_passk", "gdpo", "optimal_token_baseline"):
        assert ADVANTAGES.trait(name, "group_relative")
