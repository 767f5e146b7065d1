"""Typed parameters of the registered policy losses and advantage estimators.

One class per loss or estimator holds its real defaults; the config tree has one
section per registered name (``algo.losses.dapo.clip_high``,
``algo.advantages.gae.lam``) and the run passes the chosen name's section, every
field, as keywords. A contract test (tests/unit/algos/test_params_contract.py)
asserts that each registered function's keyword parameters, apart from the inputs
its kind's caller supplies, are exactly its class's fields with the same defaults,
so a default lives in the function's signature and here, and the two cannot drift.

This module imports nothing of rlpost: the config tree is built from it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ParamSet(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


# ------------------------------------------------------------------ policy losses


class PPOClipParams(ParamSet):
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """Lower ratio clip: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0.0)
    """Upper ratio clip: the ratio is clipped above at 1 + clip_high."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound c on the loss of negative-advantage tokens."""
    dual_clip: bool = True
    """Apply the dual clip."""
    tis_cap: float | None = Field(None, gt=0.0)
    """Cap of the truncated engine/trainer importance weight (None: off)."""


class DAPOParams(PPOClipParams):
    clip_high: float = Field(0.28, ge=0.0)
    """Upper ratio clip 1 + clip_high (DAPO's clip-higher)."""


class GSPOParams(ParamSet):
    clip_low: float = Field(3e-4, ge=0.0, le=1.0)
    """Lower clip of the sequence-level ratio: 1 - clip_low."""
    clip_high: float = Field(4e-4, ge=0.0)
    """Upper clip of the sequence-level ratio: 1 + clip_high."""


class CISPOParams(ParamSet):
    clip_low: float = Field(1.0, ge=0.0, le=1.0)
    """Lower clip of the stop-gradient importance weight: 1 - clip_low (1.0: none)."""
    clip_high: float = Field(0.28, ge=0.0)
    """Upper clip of the stop-gradient importance weight: 1 + clip_high."""
    tis_cap: float | None = Field(None, gt=0.0)
    """Cap of the truncated engine/trainer importance weight (None: off)."""


class SAPOParams(ParamSet):
    tau_pos: float = Field(1.0, gt=0.0)
    """Gate temperature for positive advantages."""
    tau_neg: float = Field(1.05, gt=0.0)
    """Gate temperature for negative advantages."""


class ReinforceParams(ParamSet):
    tis_cap: float | None = Field(None, gt=0.0)
    """Cap of the truncated engine/trainer importance weight (None: off)."""


class TrustRegionParams(ParamSet):
    divergence: Literal["binary_kl", "tv"] = "binary_kl"
    """Divergence of the trust region: binary KL or total variation."""
    tr_kl: float = Field(0.05, gt=0.0)
    """Binary-KL trust-region threshold (divergence=binary_kl)."""
    tr_tv: float = Field(0.2, gt=0.0)
    """Total-variation trust-region threshold (divergence=tv)."""
    is_cap: float = Field(2.0, gt=0.0)
    """Cap of the truncated importance weight."""


class DPPOParams(TrustRegionParams):
    is_cap: float = Field(20.0, gt=0.0)
    """Cap of the truncated importance weight."""


class DROParams(ParamSet):
    reg_coef: float = Field(1.0, ge=0.0)
    """Coefficient of the squared log-ratio penalty reg_coef/2 (lp - old)^2."""


class KLCovParams(ParamSet):
    kl_cov_ratio: float = Field(2e-4, gt=0.0, le=1.0)
    """Fraction of valid tokens, highest advantage-logprob covariance first, that get the
    KL penalty."""
    ppo_kl_coef: float = Field(1.0, ge=0.0)
    """Coefficient of |lp - old| on the selected tokens."""


class ClipCovParams(ParamSet):
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """Lower ratio clip 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0.0)
    """Upper ratio clip 1 + clip_high."""
    clip_cov_ratio: float = Field(2e-4, gt=0.0, le=1.0)
    """Fraction of valid tokens whose gradient is removed."""
    clip_cov_lb: float = 1.0
    """Lower bound of the covariance band tokens are chosen from."""
    clip_cov_ub: float = 5.0
    """Upper bound of the covariance band tokens are chosen from."""


class GMPOParams(ParamSet):
    clip_low: float = Field(0.4, ge=0.0, le=1.0)
    """Lower log-ratio clip -clip_low."""
    clip_high: float = Field(0.4, ge=0.0)
    """Upper log-ratio clip clip_high."""


class GKDParams(ParamSet):
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "jsd"
    """forward_kl: KL(teacher || student); reverse_kl: KL(student || teacher); jsd: the
    generalised Jensen-Shannon divergence with beta (GKD)."""
    beta: float = Field(0.5, gt=0.0, lt=1.0)
    """jsd's mixture weight of the teacher, m = beta teacher + (1 - beta) student."""
    distill_weight: float = Field(1.0, ge=0.0)
    """Weight of the divergence term."""
    task_weight: float = Field(0.0, ge=0.0)
    """Weight of the PPO clipped surrogate on the task advantages (0: distillation alone)."""


class LossesConfig(ParamSet):
    """Parameters of each policy loss; the run reads the section of ``algo.policy_loss``."""

    ppo_clip: PPOClipParams = PPOClipParams()
    """ppo_clip (PPO's clipped surrogate with dual clip)."""
    dapo: DAPOParams = DAPOParams()
    """dapo (ppo_clip with clip-higher)."""
    gspo: GSPOParams = GSPOParams()
    """gspo (sequence-level ratio)."""
    cispo: CISPOParams = CISPOParams()
    """cispo (clipped stop-gradient importance weight)."""
    sapo: SAPOParams = SAPOParams()
    """sapo (soft gate instead of a hard clip)."""
    reinforce: ReinforceParams = ReinforceParams()
    """reinforce (plain policy gradient)."""
    gpg: ReinforceParams = ReinforceParams()
    """gpg (plain policy gradient, GPG's name)."""
    flash_reinforce: TrustRegionParams = TrustRegionParams()
    """flash_reinforce (trust region between trainer and engine)."""
    dppo: DPPOParams = DPPOParams()
    """dppo (trust region between the current and the sampling policy)."""
    dro: DROParams = DROParams()
    """dro (squared log-ratio penalty)."""
    kl_cov: KLCovParams = KLCovParams()
    """kl_cov (KL penalty on high-covariance tokens)."""
    clip_cov: ClipCovParams = ClipCovParams()
    """clip_cov (no gradient on high-covariance tokens)."""
    gmpo: GMPOParams = GMPOParams()
    """gmpo (geometric-mean ratio)."""
    gkd: GKDParams = GKDParams()
    """gkd (teacher-student divergence over the whole vocabulary: on-policy distillation)."""


# ------------------------------------------------------------ advantage estimators


class GRPOParams(ParamSet):
    norm_by_std: bool = True
    """Divide by the std (False: Dr.GRPO's centred score)."""
    std_scope: Literal["group", "batch"] = "group"
    """The std of each group or of the whole batch (TRL's scale_rewards=batch)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""


class GRPOPassKParams(ParamSet):
    norm_by_std: bool = True
    """Divide by the group std."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""


class GDPOParams(ParamSet):
    eps: float = Field(1e-6, ge=0.0)
    """Added to each component's std before dividing."""


class OptimalBaselineParams(ParamSet):
    eps: float = Field(1e-8, ge=0.0)
    """Added to the baseline's denominator."""


class ReinforcePPParams(ParamSet):
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""


class GAEParams(ParamSet):
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """The GAE lambda."""


class VAPOGAEParams(ParamSet):
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""
    alpha: float = Field(0.05, gt=0.0)
    """Length-adaptive policy lambda = 1 - 1 / (alpha * length)."""
    value_lam: float = Field(1.0, ge=0.0, le=1.0)
    """The critic's lambda for its returns."""


class OnPolicyDistillParams(ParamSet):
    distill_weight: float = Field(1.0, ge=0.0)
    """Weight of the per-token distillation advantage -(log pi_student - log pi_teacher)."""
    task_weight: float = Field(0.0, ge=0.0)
    """Weight of GRPO's advantage on the task reward (0: the teacher alone)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the group std of the task term."""
    center: bool = False
    """Subtract the batch's mean per-token KL from the distillation term (a constant baseline:
    unbiased, lower variance)."""


class AdvantagesConfig(ParamSet):
    """Parameters of each advantage estimator that takes any; the run reads the section of
    ``algo.advantage`` (an estimator without one takes none)."""

    grpo: GRPOParams = GRPOParams()
    """grpo (group-normalised outcome)."""
    grpo_passk: GRPOPassKParams = GRPOPassKParams()
    """grpo_passk (pass@k-shaped group advantage)."""
    gdpo: GDPOParams = GDPOParams()
    """gdpo (each reward component normalised on its own)."""
    optimal_token_baseline: OptimalBaselineParams = OptimalBaselineParams()
    """optimal_token_baseline (variance-minimising per-token baseline)."""
    reinforce_pp: ReinforcePPParams = ReinforcePPParams()
    """reinforce_pp (REINFORCE++ returns, whitened over the batch)."""
    gae: GAEParams = GAEParams()
    """gae (PPO's generalised advantage estimate from the critic)."""
    vapo_gae: VAPOGAEParams = VAPOGAEParams()
    """vapo_gae (VAPO's decoupled, length-adaptive GAE)."""
    on_policy_distill: OnPolicyDistillParams = OnPolicyDistillParams()
    """on_policy_distill (the teacher's per-token reverse KL as a dense advantage)."""


def params_of(section: ParamSet, name: str) -> dict[str, Any]:
    """The keyword parameters of ``name`` in ``section`` (a LossesConfig or AdvantagesConfig):
    every field of its class, {} for a name without a class."""
    chosen = getattr(section, name, None) if name in type(section).model_fields else None
    return chosen.model_dump() if chosen is not None else {}


def changed_sections(section: ParamSet) -> list[str]:
    """Names whose parameters differ from their class's defaults."""
    return [
        name
        for name, field in type(section).model_fields.items()
        if getattr(section, name) != field.default
    ]
