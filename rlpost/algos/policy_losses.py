"""Policy-gradient losses, registered by name, all with one signature: ``fn(x, params)``.

``x`` is the micro-batch's :class:`LossInputs` (frozen, built by the trainer) and
``params`` the loss's variant of ``algo.loss`` (its class in ``rlpost.params``, which the
config builds its choice from without importing torch). A loss returns a
:class:`PolicyLossOutput`.

``x.logprobs`` are the current policy's (with gradient); ``x.old_logprobs`` the
trainer's recomputation of the behaviour policy; ``x.rollout_logprobs`` what the
engine reported while sampling. Gradients flow only through ``logprobs`` (and a
full-distribution loss's ``logits``): every other input is detached here, so a caller
cannot leak gradient by accident. The per-token loss matrix is reduced by ``x.agg``
(see ``aggregate.py``), so each loss works with every aggregation mode and stays
micro-batch invariant.

A loss declares what it reads beyond the logprobs with registry traits, and the trainer
supplies it: ``needs_teacher_logits`` (the student's and the teacher's ``[B, T, V]``
logits), ``token_selector`` (tokens chosen once per mini-batch, as ``x.selected``); the rule
table reads ``corrects_rollout`` (it weights by the engine/trainer ratio) and ``read_when``
(``{field: (knob, value)}``: a param read only while another has that value).

Every loss reports ``clip_frac`` (fraction of valid tokens whose gradient the
trust region cut) and ``approx_kl`` (masked mean of ``old_logprobs - logprobs``),
both detached scalars.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlpost.algos.aggregate import Aggregation, masked_mean
from rlpost.params import (
    CISPOParams,
    GSPOParams,
    PPOClipParams,
    ReinforceParams,
    SAPOParams,
    TrustRegionParams,
    Variant,
)
from rlpost.registry import Registry

# verl clamps the per-token log-ratio to +-20 before exp: beyond it the ratio is
# meaningless and exp would overflow; the clamp also zeroes the gradient there.
# One rule, verl's: the clamp applies where verl applies it (ppo_clip/dapo, cispo, sapo,
# dppo and every engine IS weight); gmpo, dro, kl_cov and clip_cov take the raw log-ratio.
LOG_RATIO_CLAMP = 20.0
# verl's GSPO clamps the sequence log-ratio from above only.
GSPO_LOG_RATIO_MAX = 10.0
# Added inside the binary-KL logs (as verl's dppo_kl) so p -> 1 stays finite.
BINARY_KL_EPS = 1e-8
TRUST_REGION = {"tr_tv": ("divergence", "tv"), "tr_kl": ("divergence", "binary_kl")}
DUAL_CLIP = {"clip_ratio_c": ("dual_clip", True)}


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's inputs to the loss terms; tensors ``[B, T]`` unless said otherwise.

    ``logprobs`` (with gradient), ``old_logprobs``, ``advantages`` (after any rollout
    correction), ``response_mask`` and ``agg`` (the mini-batch's denominators) are always
    there; ``rollout_logprobs`` when the engine reported them. What a loss declares:
    ``selected`` (bool, a ``token_selector``'s choice over the mini-batch), ``logits`` and
    ``teacher_logits`` ``[B, T, V]`` (``needs_teacher_logits``). The trainer's own terms
    read ``ref_logprobs`` (KL), ``entropy`` (entropy bonus), ``rewarded`` ``[B, 1]`` and
    ``nll_agg`` (NLL on the rewarded samples)."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    agg: Aggregation
    rollout_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    selected: Tensor | None = None
    logits: Tensor | None = None
    teacher_logits: Tensor | None = None
    entropy: Tensor | None = None
    rewarded: Tensor | None = None
    nll_agg: Aggregation | None = None

    def __post_init__(self) -> None:
        names = (
            "old_logprobs",
            "advantages",
            "response_mask",
            "rollout_logprobs",
            "ref_logprobs",
            "selected",
        )
        given = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        _same_shape("logprobs", self.logprobs, **given)

    def detached(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(old, advantages, mask)`` detached, the mask as bool."""
        return self.old_logprobs.detach(), self.advantages.detach(), self.response_mask.detach() > 0

    @property
    def rollout(self) -> Tensor | None:
        return None if self.rollout_logprobs is None else self.rollout_logprobs.detach()


@dataclass
class PolicyLossOutput:
    """A scalar loss to minimise and detached scalar statistics for logging."""

    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


PolicyLoss = Callable[[LossInputs, Variant], PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as ``name``; raises ``UnknownNameError`` listing valid names."""
    return POLICY_LOSSES.get(name)


def _same_shape(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    """Raise ``ValueError`` naming the first of ``others`` whose shape is not ``ref``'s."""
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} != {ref_name} shape {tuple(ref.shape)}"
            )


def _ratio(logprobs: Tensor, old: Tensor) -> tuple[Tensor, Tensor]:
    """Clamped log-ratio and ratio ``exp(clamp(lp - old, +-20))``, both ``[B, T]``."""
    log_ratio = torch.clamp(logprobs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def _raw_log_ratio(logprobs: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """``lp - old`` unclamped (verl's rule where no clamp applies), 0 on padding (finite exp)."""
    return torch.where(mask, logprobs - old, torch.zeros_like(logprobs))


def _frac(flags: Tensor, mask: Tensor) -> Tensor:
    """Detached fraction of valid tokens where ``flags`` is true."""
    return masked_mean(flags.detach().to(torch.float32), mask)


def _approx_kl(logprobs: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    return masked_mean((old - logprobs).detach(), mask)


def _zero(x: LossInputs) -> Tensor:
    return x.logprobs.new_zeros((), dtype=torch.float32)


def _tis_reduce(
    x: LossInputs, loss_mat: Tensor, stats: dict, old: Tensor, cap: float | None
) -> PolicyLossOutput:
    """``agg.reduce(loss_mat * w)`` with the truncated IS weight ``w = min(exp(old - rollout),
    cap)`` between trainer and engine (adds ``tis_weight_mean`` to ``stats``).

    Corrects for the engine's sampling distribution differing from the trainer's
    recomputation ("Your efficient RL framework secretly brings you off-policy RL
    training", Yao et al. 2025). Off (``w = 1``) unless both a cap and rollout logprobs exist."""
    mask = x.response_mask.detach() > 0
    if cap is not None and x.rollout is not None:
        weights = torch.clamp(_ratio(old, x.rollout)[1], max=cap)
        stats["tis_weight_mean"] = masked_mean(weights, mask)
        loss_mat = loss_mat * weights
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


def _clipped_surrogate(
    adv: Tensor, ratio: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's ``max(-A r, -A clip(r, 1-clip_low, 1+clip_high))`` ``[B, T]``, and where the
    clipped term won (the tokens whose gradient the trust region cut)."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("ppo_clip", read_when=DUAL_CLIP)
@POLICY_LOSSES.register("dapo", read_when=DUAL_CLIP)
def ppo_clip_loss(x: LossInputs, p: PPOClipParams) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al., arXiv 1707.06347 eq. 7) with dual clip.

    ``r = exp(clamp(lp - old, +-20))``; ``L = max(-A r, -A clip(r, 1-clip_low,
    1+clip_high))``; with ``dual_clip`` and ``A < 0``, ``L = min(L, -A c)``
    (Ye et al., arXiv 1912.09729). ``clip_high > clip_low`` is DAPO's clip-higher
    (``dapo``: the same loss with ``clip_high=0.28``, arXiv 2503.14476; its token-level
    loss is the ``token-mean`` aggregation over the whole mini-batch).
    ``tis_cap`` multiplies by the truncated engine IS weight (off by default).
    Stats: ``clip_frac`` (``L2 > L1``), ``clip_frac_lower`` (dual clip active),
    ``approx_kl`` of the clamped log-ratio."""
    old, adv, mask = x.detached()
    log_ratio, ratio = _ratio(x.logprobs, old)
    loss_mat, cut = _clipped_surrogate(adv, ratio, p.clip_low, p.clip_high)
    lower = torch.zeros_like(mask)
    if p.dual_clip:
        floor = -adv * p.clip_ratio_c
        lower = (loss_mat > floor) & (adv < 0)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, floor), loss_mat)
    stats = {
        "clip_frac": _frac(cut, mask),
        "clip_frac_lower": _frac(lower, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return _tis_reduce(x, loss_mat, stats, old, p.tis_cap)


@POLICY_LOSSES.register("gspo")
def gspo_loss(x: LossInputs, p: GSPOParams) -> PolicyLossOutput:
    """GSPO sequence-level clipping (Group Sequence Policy Optimization, arXiv 2507.18071).

    ``log s_i = sum_t (lp - old) m / n_i``; per token ``log s_it = lp - sg(lp) +
    sg(log s_i)`` clamped at max 10 (verl's GSPO-token form: value ``s_i``,
    gradient ``s_i`` through its own token); ``L = max(-A s_it, -A clip(s_it,
    1-clip_low, 1+clip_high))``. With ``seq-mean-token-mean`` aggregation the
    gradient equals the paper's sequence objective."""
    old, adv, mask = x.detached()
    lp = x.logprobs
    seq_log_ratio = masked_mean(_raw_log_ratio(lp, old, mask), mask, dim=-1).detach()
    token_log_ratio = lp - lp.detach() + seq_log_ratio[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    loss_mat, cut = _clipped_surrogate(adv, ratio, p.clip_low, p.clip_high)
    stats = {
        "clip_frac": _frac(cut, mask),
        "approx_kl": _approx_kl(lp, old, mask),
        "seq_ratio_mean": masked_mean(ratio.detach(), mask),
    }
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("cispo")
def cispo_loss(x: LossInputs, p: CISPOParams) -> PolicyLossOutput:
    """CISPO: clipped IS weight, REINFORCE gradient (MiniMax-M1, arXiv 2506.13585).

    ``L = -sg(clip(r, 1-clip_low, 1+clip_high)) A lp`` with ``r = exp(clamp(lp -
    old, +-20))``: every token keeps a gradient; clipping only bounds its weight.
    ``clip_low=1.0`` sets no lower bound, as the paper.
    ``clip_frac`` is the fraction of tokens whose weight was clipped."""
    old, adv, mask = x.detached()
    log_ratio, ratio = _ratio(x.logprobs, old)
    weight = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high).detach()
    loss_mat = -weight * adv * x.logprobs
    stats = {
        "clip_frac": _frac(weight != ratio, mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return _tis_reduce(x, loss_mat, stats, old, p.tis_cap)


@POLICY_LOSSES.register("sapo")
def sapo_loss(x: LossInputs, p: SAPOParams) -> PolicyLossOutput:
    """SAPO soft gate (Soft Adaptive Policy Optimization, arXiv 2511.20347).

    ``f(r) = sigmoid(tau (r - 1)) 4 / tau`` with ``tau = tau_pos`` if ``A > 0``
    else ``tau_neg``; ``L = -f(r) A``, gradient through the gate (``f'(1) = 1``,
    so near ``r = 1`` it is the plain policy gradient, fading smoothly off-policy).
    No hard clip: ``clip_frac`` is 0."""
    old, adv, mask = x.detached()
    log_ratio, ratio = _ratio(x.logprobs, old)
    tau = torch.where(adv > 0, p.tau_pos, p.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss_mat = -gate * adv
    stats = {
        "clip_frac": _zero(x),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
        "gate_mean": masked_mean(gate.detach(), mask),
    }
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


@POLICY_LOSSES.register("reinforce")
@POLICY_LOSSES.register("gpg")
def reinforce_loss(x: LossInputs, p: ReinforceParams) -> PolicyLossOutput:
    """REINFORCE ``L = -A lp`` (Williams 1992); also GPG's loss (arXiv 2504.02546).

    ``tis_cap`` applies the truncated engine IS weight. ``clip_frac`` is 0."""
    old, adv, mask = x.detached()
    stats = {"clip_frac": _zero(x), "approx_kl": _approx_kl(x.logprobs, old, mask)}
    return _tis_reduce(x, -adv * x.logprobs, stats, old, p.tis_cap)


def _token_divergence(logprobs: Tensor, rollout: Tensor, divergence: str) -> Tensor:
    """Per-token divergence ``[B, T]`` between trainer and engine on the sampled token.

    ``binary_kl``: KL(Bern(q) || Bern(p)) with q the engine's and p the trainer's
    probability of the sampled token; ``tv``: ``|p - q|`` (verl's dppo_kl / dppo_tv)."""
    p = torch.exp(torch.clamp(logprobs, max=0.0))
    q = torch.exp(torch.clamp(rollout, max=0.0))
    if divergence == "tv":
        return (p - q).abs()
    log_q, log_p = torch.clamp(rollout, max=0.0), torch.clamp(logprobs, max=0.0)
    tail = torch.log((1.0 - q + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))
    return q * (log_q - log_p) + (1.0 - q) * tail


@POLICY_LOSSES.register("flash_reinforce", corrects_rollout=True, read_when=TRUST_REGION)
def flash_reinforce_loss(x: LossInputs, p: TrustRegionParams) -> PolicyLossOutput:
    """Critic-free REINFORCE with truncated IS and an engine trust region.

    ``L = -A w lp keep`` with ``w = sg(min(exp(old - rollout), is_cap))`` (truncated
    IS from engine to trainer, Yao et al. 2025) and ``keep = [D(p, q) <= threshold]``
    where ``D`` is the binary KL (``tr_kl``) or total variation (``tr_tv``) between
    the current policy's (detached) and the engine's probability of the sampled
    token (the divergences of verl's ``dppo_kl`` / ``dppo_tv``). Tokens outside
    are masked, not clipped, and the mask is two-sided: mismatch is noise, not a
    direction. Without ``rollout_logprobs`` it is plain REINFORCE.
    Stats: ``trust_masked_frac`` (= ``clip_frac``), ``is_capped_frac``."""
    old, adv, mask = x.detached()
    lp, rollout = x.logprobs, x.rollout
    stats = {"approx_kl": _approx_kl(lp, old, mask)}
    if rollout is None:
        keep = torch.ones_like(mask)
        capped = torch.zeros_like(mask)
        weight = torch.ones_like(lp).detach()
    else:
        threshold = p.tr_kl if p.divergence == "binary_kl" else p.tr_tv
        keep = _token_divergence(lp.detach(), rollout, p.divergence) <= threshold
        raw = _ratio(old, rollout)[1]
        capped = raw > p.is_cap
        weight = torch.clamp(raw, max=p.is_cap)
    loss_mat = torch.where(keep, -adv * weight * lp, torch.zeros_like(lp))
    stats["trust_masked_frac"] = _frac(~keep, mask)
    stats["clip_frac"] = stats["trust_masked_frac"]
    stats["is_capped_frac"] = _frac(capped, mask)
    return PolicyLossOutput(x.agg.reduce(loss_mat, mask), stats)


# What a trainer adds to any policy loss: KL to the reference, NLL, entropy bonus. Each is
# reduced with the mini-batch's denominators, so that, like the losses, it is the same
# however a mini-batch is split; the trainer adds ``coef * term`` for each coefficient not 0.


def kl_term(x: LossInputs, estimator: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``agg(kl(logprobs, ref_logprobs), mask)``: the KL-to-reference loss (GRPO, arXiv
    2402.03300; verl ``use_kl_loss``) with a registered estimator (``kl.py``)."""
    return x.agg.reduce(estimator(x.logprobs, x.ref_logprobs), x.response_mask)


def nll_term(x: LossInputs) -> Tensor:
    """Token-mean ``-logprobs`` over the rewarded samples (``x.rewarded`` ``[B, 1]``, with
    their own denominators ``x.nll_agg``): supervised pull towards what was rewarded."""
    return x.nll_agg.reduce(-x.logprobs, x.response_mask * x.rewarded)


def entropy_term(x: LossInputs) -> Tensor:
    """``agg(entropy, mask)``, the policy's mean token entropy (a bonus: its coefficient is
    negative in the loss)."""
    return x.agg.reduce(x.entropy, x.response_mask)
