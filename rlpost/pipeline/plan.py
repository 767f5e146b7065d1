"""The step plan: what a train step needs, resolved once from the config and the registries.

Which logprob passes a step runs, whether it keeps a reference or a critic and which
inputs the advantage estimator takes follow from the config and from the traits the
algorithms were registered with, never from the batch or from what an earlier stage
happened to fill. :func:`resolve_step_plan` decides them once, at build time; the train
stage (``pipeline/stages.py``) reads the frozen :class:`StepPlan` and the builder keeps
the reference and the critic it says.

Old logprobs (the ratio's anchor) come from one of three places:

- ``rollout``: the engine's sampling logprobs (``algo.old_logprobs=rollout``), no pass;
- ``pass``: a separate forward pass of the trainer over the batch, before the update;
- ``update``: the loss pass of a single update (one epoch, one mini-batch: the policy
  computing the loss is the one that sampled), returned in the update's result.

The shortcut needs nothing to read the old logprobs before the update: the KL placed in
the reward, an estimator that takes them, a loss that selects tokens by them, and a
critic warm-up step (the policy does not train, so no loss pass runs) each need a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpost.algos import ADVANTAGES, POLICY_LOSSES
from rlpost.config import Config

OldSource = Literal["rollout", "pass", "update"]


@dataclass(frozen=True)
class StepPlan:
    """What every train step of a run computes, and where each input comes from.

    ``old_logprobs``: ``rollout`` (the engine's) or ``trainer`` (:meth:`old_source` says
    which trainer pass). ``single_update_rows``: the largest batch one optimizer step
    covers (``train.mini_batch_size`` with one epoch, else 0). ``reference``: a reference
    pass (a KL penalty, or a loss that reads ``ref_logprobs``). ``values``: critic values
    and a critic update (the estimator needs a critic). ``components``,
    ``greedy_baseline``, ``sum_pi_squared``: estimator inputs its traits ask for.
    ``kl_in_reward``: the KL penalty is subtracted from the rewards (else added to the
    loss). ``token_selector``: the loss picks tokens by the old logprobs before its
    first step. ``critic_warmup_steps``: steps the critic trains alone.
    """

    old_logprobs: Literal["trainer", "rollout"] = "trainer"
    single_update_rows: int = 0
    reference: bool = False
    values: bool = False
    components: bool = False
    greedy_baseline: bool = False
    sum_pi_squared: bool = False
    kl_in_reward: bool = False
    token_selector: bool = False
    critic_warmup_steps: int = 0
    teacher: bool = False  # the estimator reads a teacher's logprobs (on-policy distillation)
    teacher_logits: bool = False  # the loss reads the teacher's full logits (gkd)

    def trains_policy(self, step: int) -> bool:
        """Whether step ``step`` (0-based) updates the policy (not during critic warm-up)."""
        return not self.values or step >= self.critic_warmup_steps

    def old_source(self, rows: int, step: int) -> OldSource:
        """Where step ``step``'s old logprobs come from for a batch of ``rows`` rows."""
        if self.old_logprobs == "rollout":
            return "rollout"
        read_before = self.kl_in_reward or self.sum_pi_squared or self.token_selector
        read_before = read_before or self.teacher  # the distillation advantage reads them
        single = rows <= self.single_update_rows
        return "update" if single and not read_before and self.trains_policy(step) else "pass"


def resolve_step_plan(cfg: Config) -> StepPlan:
    """The :class:`StepPlan` of ``cfg`` (its ``algo``, ``train`` and ``critic`` sections)."""
    a, t = cfg.algo, cfg.train
    return StepPlan(
        old_logprobs=a.old_logprobs,
        single_update_rows=t.mini_batch_size if t.epochs == 1 else 0,
        reference=a.kl.beta > 0 or bool(POLICY_LOSSES.trait(a.loss.name, "needs_reference")),
        values=bool(ADVANTAGES.trait(a.advantage.name, "needs_critic")),
        components=bool(ADVANTAGES.trait(a.advantage.name, "needs_components")),
        greedy_baseline=bool(ADVANTAGES.trait(a.advantage.name, "needs_greedy_baseline")),
        sum_pi_squared=bool(ADVANTAGES.trait(a.advantage.name, "needs_sum_pi_squared")),
        kl_in_reward=a.kl.placement == "reward",
        token_selector=POLICY_LOSSES.trait(a.loss.name, "token_selector", None) is not None,
        critic_warmup_steps=cfg.critic.head_start_steps,
        teacher=bool(ADVANTAGES.trait(a.advantage.name, "needs_teacher")),
        teacher_logits=bool(POLICY_LOSSES.trait(a.loss.name, "needs_teacher_logits")),
    )


def checked_plan(plan: StepPlan, described: dict) -> StepPlan:
    """``plan``, after checking that the trainer worker (its ``describe()``) keeps the
    reference and the critic the plan's steps ask for."""
    for fact, key in (("reference", "has_reference"), ("values", "has_critic")):
        if bool(described.get(key)) != getattr(plan, fact):
            raise RuntimeError(
                f"the step plan's {fact}={getattr(plan, fact)} but the trainer worker reports "
                f"{key}={described.get(key)}: the trainer was built from another config"
            )
    return plan
