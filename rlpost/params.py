"""The `Choice` convention: a swappable part is ``{name: X, ...X's own parameters}``.

Every part a config chooses by name (a policy loss, an advantage estimator, a rollout
correction) is a pydantic union keyed on ``name``, built from one ``Variant`` class per
registered name. A variant holds its name and only its own knobs, so a config lists the
chosen variant's parameters and nothing else, and a knob of another variant is an unknown
key, never an ignored one. ``algo.loss.name=dapo algo.loss.clip_high=0.3`` chooses and
sets; a missing ``name`` is the part's default.

A policy loss takes its variant itself (``fn(inputs, params)``), so its defaults are
written here once. An advantage estimator takes its variant's fields as keywords
(``variant.params()``). A contract test (tests/unit/algos/test_params_contract.py) holds
each registered function to its variant.

A name with a ``:`` is the user's own code (``{name: my.py:fn, clip: 0.3}``), a
:class:`UserPart` whose other keys are its parameters.

This module imports nothing of rlpost but the registry, and not torch: the config tree is
built from it, which is why the variant classes live here and not beside their functions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_validator,
)


class ParamSet(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class Variant(ParamSet):
    """One registered part and its own parameters."""

    name: str

    def params(self) -> dict[str, Any]:
        """The keyword parameters of the chosen function: every field but ``name``."""
        return self.model_dump(exclude={"name"})


def bare(name: str) -> type[Variant]:
    """The variant of a registered part that takes no parameters."""
    return create_model(
        f"{name}_variant",
        __base__=Variant,
        name=(Literal[name], name),  # type: ignore[valid-type]
    )


class UserPart(Variant):
    """A part from the user's code: ``name`` is ``path/to/file.py:object`` or
    ``package.module:object``; the other keys are its parameters, checked by the params class
    it declares (``rlpost.registry.part(params=...)``; none declared: taken as given). The
    parameters are attributes of this record and keywords of :meth:`params`."""

    model_config = ConfigDict(extra="allow")

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _own_params(self) -> UserPart:
        from rlpost.registry import declared, import_object

        if not is_user_spec(self.name):  # a registered part (a reward term's name)
            return self
        try:
            declared_params = declared(import_object(self.name))[0]
        except ValueError as exc:
            raise ValueError(f"name={self.name}: {exc}") from None
        if declared_params is not None:  # its defaults filled in, its bounds checked
            self.__pydantic_extra__ = declared_params(**self.model_extra).model_dump()
        return self


def is_user_spec(name: Any) -> bool:
    """Whether a part's name points at user code (``file.py:fn``, ``package.module:fn``)."""
    return isinstance(name, str) and ":" in name


def choice(default: str, *variants: type[Variant], user: type[UserPart] = UserPart) -> Any:
    """A config field type: the union of ``variants`` keyed on ``name`` (``default`` when a
    mapping has none), or ``user`` when the name points at user code."""

    def tag(value: Any) -> str:
        name = value.get("name", default) if isinstance(value, dict) else value.name
        return "user" if is_user_spec(name) else name

    members = tuple(Annotated[v, Tag(v.model_fields["name"].default)] for v in variants)
    members += (Annotated[user, Tag("user")],)
    return Annotated[
        Union[members],  # noqa: UP007
        Discriminator(tag),
        BeforeValidator(lambda v: {"name": v} if isinstance(v, str) else v),  # loss=dapo
    ]


def variants(union: Any) -> dict[str, type[Variant]]:
    """The variant class of each name a choice field accepts, in declaration order."""
    found = {m.__metadata__[0].tag: m.__origin__ for m in union.__origin__.__args__}
    return {k: v for k, v in found.items() if k != "user"}


# ------------------------------------------------------------------ policy losses


class PPOClipParams(Variant):
    name: Literal["ppo_clip"] = "ppo_clip"
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
    name: Literal["dapo"] = "dapo"
    clip_high: float = Field(0.28, ge=0.0)
    """Upper ratio clip 1 + clip_high (DAPO's clip-higher)."""


class GSPOParams(Variant):
    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0.0, le=1.0)
    """Lower clip of the sequence-level ratio: 1 - clip_low."""
    clip_high: float = Field(4e-4, ge=0.0)
    """Upper clip of the sequence-level ratio: 1 + clip_high."""


class CISPOParams(Variant):
    name: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0.0, le=1.0)
    """Lower clip of the stop-gradient importance weight: 1 - clip_low (1.0: none)."""
    clip_high: float = Field(0.28, ge=0.0)
    """Upper clip of the stop-gradient importance weight: 1 + clip_high."""
    tis_cap: float | None = Field(None, gt=0.0)
    """Cap of the truncated engine/trainer importance weight (None: off)."""


class SAPOParams(Variant):
    name: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0.0)
    """Gate temperature for positive advantages."""
    tau_neg: float = Field(1.05, gt=0.0)
    """Gate temperature for negative advantages."""


class ReinforceParams(Variant):
    name: Literal["reinforce"] = "reinforce"
    tis_cap: float | None = Field(None, gt=0.0)
    """Cap of the truncated engine/trainer importance weight (None: off)."""


class TrustRegionParams(Variant):
    name: Literal["flash_reinforce"] = "flash_reinforce"
    divergence: Literal["binary_kl", "tv"] = "binary_kl"
    """Divergence of the trust region: binary KL or total variation."""
    tr_kl: float = Field(0.05, gt=0.0)
    """Binary-KL trust-region threshold (divergence=binary_kl)."""
    tr_tv: float = Field(0.2, gt=0.0)
    """Total-variation trust-region threshold (divergence=tv)."""
    is_cap: float = Field(2.0, gt=0.0)
    """Cap of the truncated importance weight."""


class DPPOParams(TrustRegionParams):
    name: Literal["dppo"] = "dppo"
    is_cap: float = Field(20.0, gt=0.0)
    """Cap of the truncated importance weight."""


class DROParams(Variant):
    name: Literal["dro"] = "dro"
    reg_coef: float = Field(1.0, ge=0.0)
    """Coefficient of the squared log-ratio penalty reg_coef/2 (lp - old)^2."""


class KLCovParams(Variant):
    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(2e-4, gt=0.0, le=1.0)
    """Fraction of valid tokens, highest advantage-logprob covariance first, that get the
    KL penalty."""
    ppo_kl_coef: float = Field(1.0, ge=0.0)
    """Coefficient of |lp - old| on the selected tokens."""


class ClipCovParams(Variant):
    name: Literal["clip_cov"] = "clip_cov"
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


class GMPOParams(Variant):
    name: Literal["gmpo"] = "gmpo"
    clip_low: float = Field(0.4, ge=0.0, le=1.0)
    """Lower log-ratio clip -clip_low."""
    clip_high: float = Field(0.4, ge=0.0)
    """Upper log-ratio clip clip_high."""


class GKDParams(Variant):
    name: Literal["gkd"] = "gkd"
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "jsd"
    """forward_kl: KL(teacher || student); reverse_kl: KL(student || teacher); jsd: the
    generalised Jensen-Shannon divergence with beta (GKD)."""
    beta: float = Field(0.5, gt=0.0, lt=1.0)
    """jsd's mixture weight of the teacher, m = beta teacher + (1 - beta) student."""
    distill_weight: float = Field(1.0, ge=0.0)
    """Weight of the divergence term."""
    task_weight: float = Field(0.0, ge=0.0)
    """Weight of the PPO clipped surrogate on the task advantages (0: distillation alone)."""


class GPGParams(ReinforceParams):
    name: Literal["gpg"] = "gpg"


LossChoice = choice(
    "ppo_clip", PPOClipParams, DAPOParams, GSPOParams, CISPOParams, SAPOParams,
    ReinforceParams, GPGParams, TrustRegionParams, DPPOParams, DROParams, KLCovParams,
    ClipCovParams, GMPOParams, GKDParams,
)  # fmt: skip
"""A policy loss (docs/algorithms.md)."""


# ------------------------------------------------------------ advantage estimators


class GRPOParams(Variant):
    name: Literal["grpo"] = "grpo"
    norm_by_std: bool = True
    """Divide by the std (False: Dr.GRPO's centred score)."""
    std_scope: Literal["group", "batch"] = "group"
    """The std of each group or of the whole batch (TRL's scale_rewards=batch)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""


class GRPOPassKParams(Variant):
    name: Literal["grpo_passk"] = "grpo_passk"
    norm_by_std: bool = True
    """Divide by the group std."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""


class GDPOParams(Variant):
    name: Literal["gdpo"] = "gdpo"
    eps: float = Field(1e-6, ge=0.0)
    """Added to each component's std before dividing."""


class OptimalBaselineParams(Variant):
    name: Literal["optimal_token_baseline"] = "optimal_token_baseline"
    eps: float = Field(1e-8, ge=0.0)
    """Added to the baseline's denominator."""


class ReinforcePPParams(Variant):
    name: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""


class GAEParams(Variant):
    name: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """The GAE lambda."""


class VAPOGAEParams(Variant):
    name: Literal["vapo_gae"] = "vapo_gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""
    alpha: float = Field(0.05, gt=0.0)
    """Length-adaptive policy lambda = 1 - 1 / (alpha * length)."""
    value_lam: float = Field(1.0, ge=0.0, le=1.0)
    """The critic's lambda for its returns."""


class OnPolicyDistillParams(Variant):
    name: Literal["on_policy_distill"] = "on_policy_distill"
    distill_weight: float = Field(1.0, ge=0.0)
    """Weight of the per-token distillation advantage -(log pi_student - log pi_teacher)."""
    task_weight: float = Field(0.0, ge=0.0)
    """Weight of GRPO's advantage on the task reward (0: the teacher alone)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the group std of the task term."""
    center: bool = False
    """Subtract the batch's mean per-token KL from the distillation term (a constant baseline:
    unbiased, lower variance)."""


AdvantageChoice = choice(
    "grpo", GRPOParams, GRPOPassKParams, GDPOParams, OptimalBaselineParams, ReinforcePPParams,
    GAEParams, VAPOGAEParams, OnPolicyDistillParams,
    *map(bare, ("dr_grpo", "gpg", "opo", "reinforce_pp_baseline", "remax", "rloo")),
)  # fmt: skip
"""An advantage estimator (docs/algorithms.md)."""


# ------------------------------------------------------------- rollout corrections


class NoCorrection(Variant):
    """No correction."""

    name: Literal["none"] = "none"


class TISCorrection(Variant):
    """Token-level truncated importance sampling."""

    name: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0.0)
    """Upper bound of the truncated importance weight."""


class SeqTISCorrection(TISCorrection):
    """Sequence-level truncated importance sampling."""

    name: Literal["seq_tis"] = "seq_tis"  # type: ignore[assignment]


class MaskCorrection(Variant):
    """IcePop: tokens whose ratio leaves [low, high] are masked."""

    name: Literal["mask"] = "mask"
    low: float = Field(0.5, ge=0.0, lt=1.0)
    """Lower edge of the accepted ratio band."""
    high: float = Field(5.0, gt=1.0)
    """Upper edge of the accepted ratio band."""


class SeqMaskCorrection(MaskCorrection):
    """Rows with a token whose ratio leaves [low, high] are masked whole; kept rows get a
    truncated sequence weight."""

    name: Literal["seq_mask"] = "seq_mask"  # type: ignore[assignment]
    cap: float = Field(2.0, gt=0.0)
    """Upper bound of the truncated importance weight."""


CorrectionChoice = choice(
    "none", NoCorrection, TISCorrection, SeqTISCorrection, MaskCorrection, SeqMaskCorrection
)
"""An importance correction between the sampling engine and the trainer."""
