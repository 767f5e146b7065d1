"""Policy losses: hand-computed cases, gradient paths, masking and micro-batch invariance (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos import AGGREGATIONS, POLICY_LOSSES, Aggregation, get_policy_loss
from rlpost.params import LossChoice, variants
from rlpost.registry import UnknownNameError
from tests.unit.algos.losscall import policy_loss

TOKEN_MEAN = Aggregation("token-mean")


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def tokens(ratios, advs, old=-1.0):
    """One row whose log-ratios give ``ratios``; returns (lp leaf, old, adv, mask)."""
    old_t = torch.full((1, len(ratios)), old)
    lp = (old_t + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return lp, old_t, row(advs), torch.ones(1, len(ratios))


def random_batch(seed=0, batch=6, width=7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=gen) * 3.0 - 0.05
    lp = (old + torch.randn(batch, width, generator=gen) * 0.3).clamp(max=-1e-3)
    rollout = (old + torch.randn(batch, width, generator=gen) * 0.1).clamp(max=-1e-3)
    adv = torch.randn(batch, 1, generator=gen).expand(batch, width).clone()
    lengths = [7, 3, 5, 0, 1, 6][:batch]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    return lp, old, adv, mask, rollout


def run(name, lp, old, adv, mask, agg=TOKEN_MEAN, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    out = policy_loss(name)(lp, old, adv, mask, agg=agg, **kw)
    out.loss.backward()
    return out, lp.grad


def test_ppo_clip_hand_computed():
    lp, old, adv, mask = tokens([1.5, 1.5, 4.0, 0.5, 0.5], [1.0, -1.0, -1.0, 1.0, -1.0])
    out = policy_loss("ppo_clip")(lp, old, adv, mask, agg=TOKEN_MEAN)
    # per token: -1.2 (clip high), 1.5, 3 (dual clip caps 4), -0.5, 0.8 (clip low)
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 + 3.0 - 0.5 + 0.8) / 5, rel=1e-6)
    assert out.stats["clip_frac"].item() == pytest.approx(0.4)
    assert out.stats["clip_frac_lower"].item() == pytest.approx(0.2)
    log_r = [math.log(1.5), math.log(1.5), math.log(4.0), math.log(0.5), math.log(0.5)]
    assert out.stats["approx_kl"].item() == pytest.approx(-sum(log_r) / 5, rel=1e-5)
    out.loss.backward()
    # only unclipped tokens carry gradient -A r / N
    torch.testing.assert_close(lp.grad, row([0.0, 1.5 / 5, 0.0, -0.5 / 5, 0.0]))


def test_ppo_clip_without_dual_clip_and_dapo_clip_higher():
    lp, old, adv, mask = tokens([4.0, 1.5], [-1.0, 1.0])
    plain = policy_loss("ppo_clip")(lp, old, adv, mask, agg=TOKEN_MEAN, dual_clip=False)
    assert plain.loss.item() == pytest.approx((4.0 - 1.2) / 2, rel=1e-6)
    dapo = policy_loss("dapo")(lp, old, adv, mask, agg=TOKEN_MEAN)
    assert dapo.loss.item() == pytest.approx((3.0 - 1.28) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("ppo_clip")(lp, old, adv, mask, agg=TOKEN_MEAN, clip_ratio_c=0.9)


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
@pytest.mark.parametrize("name", ["ppo_clip", "dapo", "gspo"])
def test_ratio_one_gives_minus_aggregated_advantage(name, mode):
    _, old, adv, mask, _ = random_batch(1)
    agg = Aggregation(mode)
    out = policy_loss(name)(old.clone().requires_grad_(True), old, adv, mask, agg=agg)
    torch.testing.assert_close(out.loss, agg.reduce(-adv, mask))
    assert out.stats["clip_frac"].item() == 0.0


def test_gspo_hand_computed_and_clamp():
    old = torch.full((3, 2), -1.0)
    delta = torch.tensor([[0.1, 0.3], [1e-4, -1e-4], [11.0, 11.0]])
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0], [-1.0, -1.0]])
    out, grad = run(
        "gspo", old + delta, old, adv, torch.ones(3, 2), Aggregation("seq-mean-token-mean")
    )
    # row 0: s = e^0.2 clipped to 1.0004; row 1: s = 1 inside; row 2: log s = 11 clamped to 10
    expected = (-1.0004 + -2.0 * 1.0 + math.exp(10.0)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.stats["clip_frac"].item() == pytest.approx(2 / 6)
    # row 1 is unclipped: per-token gradient -A s / (n_i * rows); clipped / clamped rows: 0
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [-2 / 6, -2 / 6], [0.0, 0.0]]))


def test_gspo_gradient_is_sequence_objective_gradient():
    lp, old, adv, mask, _ = random_batch(2)
    lp = (old + (lp - old) * 1e-4).detach()  # stay inside the narrow GSPO clip range
    agg = Aggregation("seq-mean-token-mean")
    _, grad = run("gspo", lp, old, adv, mask, agg)
    # differentiate the paper's objective -A_i s_i, s_i = exp(mean_t(lp - old)), through the mean
    x = lp.clone().requires_grad_(True)
    n = mask.sum(-1)
    seq_log = ((x - old) * mask).sum(-1) / n.clamp(min=1)
    nonempty = n > 0
    objective = -(adv[:, 0] * torch.exp(seq_log))[nonempty].sum() / nonempty.sum()
    objective.backward()
    torch.testing.assert_close(grad, x.grad * mask, rtol=1e-5, atol=1e-7)


def test_cispo_hand_computed():
    lp, old, adv, mask = tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0])
    out = policy_loss("cispo")(lp, old, adv, mask, agg=TOKEN_MEAN)
    weights = [1.28, 0.5, 1.1]  # clip_low=1.0: no lower bound; clip_high=0.28
    lp_vals = lp.detach()[0].tolist()
    expected = (
        -sum(w * a * v for w, a, v in zip(weights, [1.0, 1.0, -1.0], lp_vals, strict=True)) / 3
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.stats["clip_frac"].item() == pytest.approx(1 / 3)
    out.loss.backward()
    # every token keeps a gradient, weighted by the clipped ratio
    torch.testing.assert_close(lp.grad, row([-1.28 / 3, -0.5 / 3, 1.1 / 3]))
    low, grad_low = run("cispo", lp, old, adv, mask, clip_low=0.2)
    assert grad_low[0, 1].item() == pytest.approx(-0.8 / 3, rel=1e-6)
    assert low.stats["clip_frac"].item() == pytest.approx(2 / 3)


def sapo_gate(r, tau):
    return 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))


def test_sapo_hand_computed_and_unit_slope():
    lp, old, adv, mask = tokens([1.5, 0.5], [1.0, -1.0])
    out = policy_loss("sapo")(lp, old, adv, mask, agg=TOKEN_MEAN)
    expected = (-sapo_gate(1.5, 1.0) + sapo_gate(0.5, 1.05)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    # at r = 1 the gate has slope 1: gradient -A r f'(1) / N = -A / N
    lp1, old1, adv1, mask1 = tokens([1.0, 1.0], [2.0, -3.0])
    _, grad = run("sapo", lp1, old1, adv1, mask1)
    torch.testing.assert_close(grad, row([-1.0, 1.5]))


@pytest.mark.parametrize("name", ["reinforce", "gpg"])
def test_reinforce_hand_computed(name):
    lp, old, adv, mask = tokens([1.2, 0.7], [2.0, -1.0])
    out, grad = run(name, lp, old, adv, mask)
    vals = lp.detach()[0].tolist()
    assert out.loss.item() == pytest.approx(-(2.0 * vals[0] - vals[1]) / 2, rel=1e-6)
    torch.testing.assert_close(grad, row([-1.0, 0.5]))


def binary_kl(q, p):
    return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


def test_flash_reinforce_trust_region_and_is_cap():
    p = [0.5, 0.9, 0.4, 0.6]  # trainer probabilities of the sampled tokens
    q = [0.45, 0.3, 0.38, 0.59]  # engine probabilities
    lp = torch.log(row(p)).requires_grad_(True)
    rollout = torch.log(row(q))
    old = rollout + torch.log(row([1.1, 1.0, 3.0, 0.9]))  # IS weights exp(old - rollout)
    adv, mask = row([1.0, 1.0, -1.0, 2.0]), torch.ones(1, 4)
    assert binary_kl(0.3, 0.9) > 0.05 > max(binary_kl(a, b) for a, b in [(0.45, 0.5), (0.38, 0.4)])
    out = policy_loss("flash_reinforce")(
        lp, old, adv, mask, agg=TOKEN_MEAN, rollout_logprobs=rollout
    )
    out.loss.backward()
    # token 1 leaves the trust region; token 2's weight 3.0 is capped at 2.0
    torch.testing.assert_close(lp.grad, row([-1.1, 0.0, 2.0, -1.8]) / 4, rtol=1e-5, atol=1e-7)
    assert out.stats["trust_masked_frac"].item() == pytest.approx(0.25)
    assert out.stats["clip_frac"].item() == pytest.approx(0.25)
    assert out.stats["is_capped_frac"].item() == pytest.approx(0.25)
    tv = policy_loss("flash_reinforce")(
        lp, old, adv, mask, agg=TOKEN_MEAN, rollout_logprobs=rollout, divergence="tv", tr_tv=0.1
    )
    # |p - q| = 0.05, 0.6, 0.02, 0.01: only token 1 exceeds 0.1 (no token sits on the
    # threshold, where float32 rounding of p and q would decide the verdict per CPU)
    assert tv.stats["trust_masked_frac"].item() == pytest.approx(0.25)


def test_flash_reinforce_without_rollout_is_reinforce():
    lp, old, adv, mask, _ = random_batch(3)
    a, grad_a = run("flash_reinforce", lp, old, adv, mask)
    b, grad_b = run("reinforce", lp, old, adv, mask)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(grad_a, grad_b)


def test_truncated_is_weights_on_ppo_clip():
    lp, old, adv, mask = tokens([1.0, 1.0], [1.0, 1.0])
    rollout = old - torch.log(row([0.5, 4.0]))  # exp(old - rollout) = 0.5, 4 -> capped 2
    out, grad = run("ppo_clip", lp, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0)
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2, rel=1e-6)
    torch.testing.assert_close(grad, row([-0.25, -1.0]))
    assert out.stats["tis_weight_mean"].item() == pytest.approx(1.25)
    off, _ = run("ppo_clip", lp, old, adv, mask, rollout_logprobs=rollout)
    assert off.loss.item() == pytest.approx(-1.0)


def loss_kwargs(name, rollout):
    return {"rollout_logprobs": rollout} if name == "flash_reinforce" else {}


# A loss over whole distributions (gkd) takes logits, not only logprobs: its own checks
# (masked rows, micro-batch invariance, gradient to the student only) are in test_distill.py.
LOGPROB_LOSSES = [
    n for n in POLICY_LOSSES.names() if not POLICY_LOSSES.trait(n, "needs_teacher_logits")
]


def selected_kwargs(name, lp, adv, mask):
    """A selector loss's tokens, chosen once over the whole mini-batch as the trainer does."""
    select = POLICY_LOSSES.trait(name, "token_selector", None)
    if select is None:
        return lambda part: {}
    wide = {
        "kl_cov": {"kl_cov_ratio": 0.2},
        "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0},
    }
    chosen = select(lp.detach(), adv, mask, variants(LossChoice)[name](**wide[name]))
    return lambda part: {"selected": chosen[part]}


@pytest.mark.parametrize("name", LOGPROB_LOSSES)
def test_gradients_flow_only_through_logprobs(name):
    lp, old, adv, mask, rollout = random_batch(4)
    others = [t.clone().requires_grad_(True) for t in (old, adv, rollout, old)]
    lp = lp.clone().requires_grad_(True)
    out = policy_loss(name)(
        lp,
        others[0],
        others[1],
        mask,
        agg=TOKEN_MEAN,
        rollout_logprobs=others[2],
        ref_logprobs=others[3],
    )
    out.loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert all(t.grad is None for t in others)
    assert {"clip_frac", "approx_kl"} <= set(out.stats)
    for value in out.stats.values():
        assert value.dim() == 0 and not value.requires_grad and torch.isfinite(value)


@pytest.mark.parametrize("name", LOGPROB_LOSSES)
def test_masked_tokens_change_nothing(name):
    lp, old, adv, mask, rollout = random_batch(5)
    pad = mask == 0
    junk = [t.clone() for t in (lp, old, adv, rollout)]
    junk[0][pad], junk[1][pad], junk[2][pad], junk[3][pad] = 50.0, -50.0, 1e3, -80.0
    clean_out, clean_grad = run(name, lp, old, adv, mask, **loss_kwargs(name, rollout))
    junk_out, junk_grad = run(name, *junk[:3], mask, **loss_kwargs(name, junk[3]))
    torch.testing.assert_close(junk_out.loss, clean_out.loss)
    torch.testing.assert_close(junk_grad, clean_grad)
    assert torch.equal(junk_grad[pad], torch.zeros_like(junk_grad[pad]))
    for key, value in clean_out.stats.items():
        torch.testing.assert_close(junk_out.stats[key], value)


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
@pytest.mark.parametrize("name", LOGPROB_LOSSES)
def test_micro_batch_invariance(name, mode):
    lp, old, adv, mask, rollout = random_batch(6)
    agg = Aggregation.for_minibatch(mask, mode=mode)
    selected = selected_kwargs(name, lp, adv, mask)
    everything = slice(0, 6)
    full, full_grad = run(
        name, lp, old, adv, mask, agg, **loss_kwargs(name, rollout), **selected(everything)
    )
    if selected(everything):
        assert selected(everything)["selected"].any()
    total, grads = torch.zeros(()), []
    for part in (slice(0, 2), slice(2, 3), slice(3, 6)):
        out, grad = run(
            name,
            lp[part],
            old[part],
            adv[part],
            mask[part],
            agg,
            **loss_kwargs(name, rollout[part]),
            **selected(part),
        )
        total, grads = total + out.loss.detach(), [*grads, grad]
    torch.testing.assert_close(total, full.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-5, atol=1e-7)


def test_lookup_and_parameter_errors():
    lp, old, adv, mask, _ = random_batch(7)
    with pytest.raises(UnknownNameError, match=r"valid: .*ppo_clip"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match="tau_pos"):
        policy_loss("ppo_clip")(lp, old, adv, mask, agg=TOKEN_MEAN, tau_pos=1.0)
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss("reinforce")(lp, old, adv[:, :3], mask, agg=TOKEN_MEAN)
    with pytest.raises(ValueError, match="divergence"):
        policy_loss("flash_reinforce")(lp, old, adv, mask, agg=TOKEN_MEAN, divergence="js")
