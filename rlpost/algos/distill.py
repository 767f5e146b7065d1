"""On-policy distillation: a teacher scores the student's own samples.

Two forms, both registered so they compose with the rest of ``algos``:

- ``on_policy_distill`` (advantage estimator): each token's advantage is ``-k_t``,
  ``k_t = log pi_s(y_t) - log pi_t(y_t)`` (Thinking Machines 2025; GKD, arXiv 2306.13649).
- ``gkd`` (policy loss): a divergence between the whole next-token distributions
  (GKD eq. 1 / TRL's ``generalized_jsd_loss``) plus ``task_weight`` times PPO's surrogate.

``lp_s`` is ``old_logprobs``; the teacher's are at temperature 1 on the same token ids.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlpost.algos.advantages import ADVANTAGES, grpo_advantages
from rlpost.algos.aggregate import masked_mean
from rlpost.algos.policy_losses import POLICY_LOSSES, LossInputs, PolicyLossOutput, ppo_clip_loss
from rlpost.params import GKDParams, PPOClipParams

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def reverse_kl_tokens(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` per-token reverse-KL estimate ``lp_s - lp_t`` on the sampled tokens, 0 where
    ``mask`` is 0 (float32). Its mean over the student's samples estimates KL(pi_s || pi_t)."""
    if student_logprobs.shape != teacher_logprobs.shape or mask.shape != student_logprobs.shape:
        raise ValueError(
            f"student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} logprobs must have one [B, T] shape"
        )
    diff = student_logprobs.float() - teacher_logprobs.float()
    return torch.where(mask > 0, diff, torch.zeros_like(diff))


def distill_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> float:
    """The step's teacher-student KL: masked mean of :func:`reverse_kl_tokens` (0 for no token)."""
    return float(masked_mean(reverse_kl_tokens(student_logprobs, teacher_logprobs, mask), mask))


@ADVANTAGES.register("on_policy_distill", needs_teacher=True)
@torch.no_grad()
def on_policy_distill_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    *,
    values: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    distill_weight: float = 1.0,
    task_weight: float = 0.0,
    eps: float = 1e-6,
    center: bool = False,
) -> tuple[Tensor, Tensor]:
    """``A[i, t] = distill_weight * -(lp_s - lp_t)[i, t] + task_weight * A_grpo[i, t]``
    (GKD, arXiv 2306.13649; Thinking Machines 2025); ``center`` subtracts the mean ``k``."""
    if old_logprobs is None or teacher_logprobs is None:
        raise ValueError("advantage estimator 'on_policy_distill' needs old and teacher logprobs")
    kl = reverse_kl_tokens(old_logprobs, teacher_logprobs, response_mask).to(torch.float64)
    if center:
        valid = response_mask > 0
        kl = kl - (kl.sum() / valid.sum().clamp(min=1))
    adv = -distill_weight * kl
    if task_weight != 0.0:
        task, _ = grpo_advantages(token_level_rewards, response_mask, group, eps=eps)
        adv = adv + task_weight * task.to(torch.float64)
    adv = torch.where(response_mask > 0, adv, 0.0).to(token_level_rewards.dtype)
    return adv, adv


def divergence_tokens(
    logits: Tensor, teacher_logits: Tensor, divergence: str = "jsd", beta: float = 0.5
) -> Tensor:
    """``[B, T]`` divergence between next-token distributions, from logits ``[B, T, V]``.

    ``forward_kl``: KL(p_t || p_s); ``reverse_kl``: KL(p_s || p_t); ``jsd``: the generalised
    JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = beta p_t + (1 - beta) p_s``
    (GKD; TRL's convention)."""
    if logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(logits.shape)} != teacher logits {tuple(teacher_logits.shape)}"
        )
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
    s = torch.log_softmax(logits.float(), dim=-1)
    t = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    if divergence == "forward_kl":
        return (t.exp() * (t - s)).sum(-1)
    if divergence == "reverse_kl":
        return (s.exp() * (s - t)).sum(-1)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta}; use forward_kl or reverse_kl")
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1.0 - beta)]), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1.0 - beta) * (s.exp() * (s - m)).sum(-1)


@POLICY_LOSSES.register("gkd", needs_teacher_logits=True)
def gkd_loss(x: LossInputs, p: GKDParams) -> PolicyLossOutput:
    """``distill_weight * agg(D(p_t, p_s)) + task_weight * ppo_clip(advantages)`` (GKD,
    arXiv 2306.13649, eq. 1), ``D`` as :func:`divergence_tokens` on ``[B, T, V]`` logits."""
    if x.logits is None or x.teacher_logits is None:
        raise ValueError("policy loss 'gkd' needs the student's and the teacher's full logits")
    mask = x.response_mask.detach()
    div = divergence_tokens(x.logits, x.teacher_logits, p.divergence, p.beta)
    loss = p.distill_weight * x.agg.reduce(div, mask)
    stats = {"distill_div": masked_mean(div.detach(), mask)}
    if p.task_weight != 0.0:
        pg = ppo_clip_loss(x, PPOClipParams())
        loss = loss + p.task_weight * pg.loss
        stats |= pg.stats
    return PolicyLossOutput(loss, stats)
