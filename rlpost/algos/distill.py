"""On-policy distillation: a teacher scores the student's own samples.

Two forms, both registered so they compose with the rest of ``algos``:

- ``on_policy_distill`` (advantage estimator): the per-token reverse KL estimate on the
  sampled token, ``k_t = log pi_s(y_t) - log pi_t(y_t)``, is a dense per-token reward
  with discount zero, so each token's advantage is ``-k_t`` (Thinking Machines, "On-Policy
  Distillation", 2025; Agarwal et al., "On-Policy Distillation of Language Models:
  Learning from Self-Generated Mistakes" (GKD), arXiv 2306.13649). Any policy loss takes
  it (``ppo_clip``: the importance ratio covers the off-policy mini-batches). A verifiable
  reward joins with a weight: ``A = task_weight * A_grpo + distill_weight * (-k)``.
- ``gkd`` (policy loss): the divergence between the teacher's and the student's whole
  next-token distributions at every sampled position (forward KL, reverse KL or the
  generalised Jensen-Shannon divergence with ``beta``, GKD eq. 1 / TRL's
  ``generalized_jsd_loss``), plus ``task_weight`` times the PPO clipped surrogate.

The student's log-probs ``lp_s`` are the sampling policy's (``old_logprobs``); the
teacher's are at temperature 1 on the same token ids (the same tokenizer is required).
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
    (on-policy distillation: GKD, arXiv 2306.13649; Thinking Machines 2025).

    ``old_logprobs`` (the student that sampled) and ``teacher_logprobs``: ``[B, T]``.
    The distillation term is per token, undiscounted and unnormalised (each token's own
    reverse KL); ``center`` subtracts the batch's mean ``k`` over valid tokens first (a
    constant baseline: unbiased, as ``E[grad log pi] = 0``, and with less variance). The
    task term is GRPO's group-normalised outcome advantage with ``eps`` (computed only when
    ``task_weight`` is not 0). Zero on padding; returns = advantages.
    """
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
    (GKD; TRL's convention: ``beta -> 0`` tends to forward KL, ``beta -> 1`` to reverse KL,
    each scaled by ``beta`` resp. ``1 - beta``). Gradient flows through ``logits`` only.
    """
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
    Agarwal et al., arXiv 2306.13649, eq. 1 with the student's own samples).

    ``x.logits`` ``[B, T, V]``: the student's (with gradient) at each response position;
    ``x.teacher_logits`` ``[B, T, V]``: the teacher's on the same positions. ``D``: see
    :func:`divergence_tokens`. The PPO term uses its default clips. Stats: ``distill_div``
    (the divergence's masked mean), and the PPO term's when it is on.
    """
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
