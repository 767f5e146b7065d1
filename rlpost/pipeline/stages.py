"""The two stages every loop is made of.

    rollout_stage:  prompts --rollout worker--> groups --reward worker--> scored groups
    train_stage:    scored groups --collate, old/ref logprobs, advantages--> trainer update --> StepStats

Both talk to workers only through their protocols (``pipeline/workers.py``), so
the synchronous loop (``loop.py``) is their composition, and a one-step-off or
asynchronous loop can run the same two functions on different threads with
the rollout of step k+1 in flight while step k trains.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from rlpost.algos import (
    get_advantage_estimator,
    get_kl_estimator,
    kl_penalized_rewards,
    masked_mean,
    scores_to_token_rewards,
)
from rlpost.algos.distill import distill_kl
from rlpost.algos.kl import KLCoefficient
from rlpost.algos.sampling import spread_per_group
from rlpost.config import AlgoConfig
from rlpost.data import PromptSampler
from rlpost.observe import Guards
from rlpost.pipeline.evaluate import logprob_gap, rollout_health
from rlpost.pipeline.workers import RewardAPI, RolloutAPI, TrainerAPI
from rlpost.resolved import StepPlan
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.train.batch import TrainBatch, collate, token_logprobs
from rlpost.types import Group

log = logging.getLogger(__name__)


@dataclass
class RolloutOutput:
    """Scored groups for one step, the rounds DAPO dynamic sampling took, the worker's stats."""

    groups: list[Group]
    rounds: int = 1
    stats: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    generated: int = 0  # tokens the policy sampled in every round, dropped groups included
    why: str = ""  # :attr:`RolloutResult.why` of the last round


def sampled_tokens(groups: list[Group]) -> int:
    """Tokens the policy sampled in ``groups`` (a tool's tokens in an episode are not)."""
    return sum(
        len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask)
        for g in groups
        for c in g.completions
    )


@dataclass
class StepStats:
    """What a train stage did: the step's metrics and the guard actions the loop must carry out."""

    metrics: dict[str, float]
    actions: list = field(default_factory=list)
    version: int = 0
    tokens: float = 0.0  # trained response tokens
    attended: float = 0.0  # prompt + response tokens the trainer's passes attend to
    seq_len: int = 0  # padded width of the batch


@dataclass
class RolloutSettings:
    """The fields of the config the rollout stage reads (STYLE rule 7)."""

    n: int
    prompts_per_step: int
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 1
    partial: bool = False
    greedy_baseline: bool = False  # ReMax: also answer each kept prompt greedily, score it


def rollout_stage(
    rollout: RolloutAPI,
    reward: RewardAPI,
    sampler: PromptSampler,
    params: SamplingParams,
    s: RolloutSettings,
    *,
    last: bool = False,
) -> RolloutOutput:
    """Sample prompts, generate ``n`` completions each, score them.

    With DAPO dynamic sampling, groups whose rewards are all equal carry no
    gradient: they are dropped and more prompts are sampled, up to
    ``max_sampling_rounds`` rounds; the kept groups are what trains. With
    partial rollout every group that finished trains (carried ones included)."""
    t0 = time.perf_counter()
    kept: list[Group] = []
    rounds, stats, groups, generated = 0, {}, [], 0
    while rounds < (s.max_sampling_rounds if s.dynamic_sampling else 1):
        rounds += 1
        result = rollout.generate(sampler.next_batch(), params, s.n, train=True, last=last)
        stats = result.stats
        generated += sampled_tokens(result.groups)
        groups = reward.score(result.groups)
        spread = spread_per_group([g.scores for g in groups]) if s.dynamic_sampling else None
        keep = [g for i, g in enumerate(groups) if spread is None or spread[i]]
        if not s.partial:  # DAPO fills the batch exactly; finished partial groups all train
            keep = keep[: s.prompts_per_step - len(kept)]
        kept += keep
        if len(kept) >= s.prompts_per_step:
            break
    if not kept:  # every group was flat in every round: train on the last round (zero advantage)
        kept = groups
    if s.greedy_baseline:
        kept, greedy = greedy_baselines(rollout, reward, kept, params)
        generated += greedy
    return RolloutOutput(kept, rounds, stats, time.perf_counter() - t0, generated, result.why)


def greedy_baselines(
    rollout: RolloutAPI, reward: RewardAPI, groups: list[Group], params: SamplingParams
) -> tuple[list[Group], int]:
    """The groups with ``baseline_score``: the reward of one greedy answer to each prompt,
    and the tokens those answers took.

    Costs one more generate call of one greedy sample per prompt (a ``1/n`` share
    of the step's sampling) and its scoring, in the same rollout stage."""
    greedy = rollout.generate([g.prompt for g in groups], replace(params, temperature=0.0), 1)
    scored = reward.score(greedy.groups)
    out = [replace(g, baseline_score=b.scores[0]) for g, b in zip(groups, scored, strict=True)]
    return out, sampled_tokens(greedy.groups)


def collate_groups(groups: list[Group], pad_id: int) -> TrainBatch:
    """A :class:`TrainBatch` of every completion, ``group`` = the record's index."""
    completions = [c for g in groups for c in g.completions]
    scores = [s for g in groups for s in g.scores]
    batch = collate(completions, scores, pad_id)
    group = torch.tensor([i for i, g in enumerate(groups) for _ in range(g.n)])
    return replace(batch, group=group)


@dataclass
class TrainSettings:
    """The fields of the config the train stage reads: the algorithm's and the step plan.
    Built once per run; ``estimator`` is the advantage estimator with its parameters bound."""

    algo: AlgoConfig
    plan: StepPlan  # the run facts' step plan, resolved once per run
    teacher: object = None  # the distillation teacher the plan reads (TeacherAPI), or None
    estimator: Callable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.estimator = bound_estimator(self.algo)


def bound_estimator(algo: AlgoConfig) -> Callable:
    """``algo.advantage``'s registered estimator with its parameters bound."""
    return partial(get_advantage_estimator(algo.advantage.name), **algo.advantage.params())


@dataclass(frozen=True)
class Advantages:
    """What the estimator made of a batch: ``token_level_rewards``, ``advantages`` and
    ``returns``, each ``[B, T]``."""

    token_level_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def train_stage(
    groups: list[Group],
    trainer: TrainerAPI,
    s: TrainSettings,
    *,
    pad_id: int,
    kl_coef: KLCoefficient | None = None,
    guards: Guards | None = None,
    step: int = 0,
) -> StepStats:
    """Old / reference logprobs, values, advantages, critic and policy updates for ``groups``.

    Each input is a record built once and never written after: the collated batch, the
    logprobs and values the plan asks for, the advantages, the update's result. The
    trainer gets a batch holding all of them and returns what it computed."""
    kl_coef = kl_coef if kl_coef is not None else KLCoefficient(0.0)
    algo, plan = s.algo, s.plan
    batch, dropped = trainable_batch(groups, pad_id, guards)
    source = plan.old_source(len(batch), step)
    old = None
    if source == "rollout":  # the engine's sampling logprobs: no trainer pass
        old = batch.rollout_logprobs * batch.response_mask
    elif source == "pass":
        old = trainer.logprobs(batch, "old")
    scored = replace(
        batch,
        old_logprobs=old,
        ref_logprobs=trainer.logprobs(batch, "ref") if plan.reference else None,
        values=trainer.values(batch) if plan.values else None,
    )
    scored, teacher_seconds = with_teacher(scored, s.teacher, plan)
    inputs = estimator_inputs(groups, scored, trainer, plan)
    turn = turn_rewards(groups, batch.response_mask)
    adv = compute_advantages(
        scored, algo, beta=kl_coef.in_reward, inputs=inputs, turn_rewards=turn, bound=s.estimator
    )
    ready = replace(scored, **vars(adv))
    critic_stats = trainer.update_critic(ready) if plan.values else {}
    result = trainer.update(ready, beta=kl_coef.in_loss, train_policy=plan.trains_policy(step))
    if source == "update":  # the single update's own loss pass
        old = result.old_logprobs
    actions = []
    if result.stats and guards is not None:
        bad = guards.check_update(
            result.stats.get("loss", math.nan), result.stats.get("grad_norm", math.nan)
        )
        actions += [bad] if bad is not None else []
    kl_value = kl_to_reference(old, scored.ref_logprobs, batch.response_mask, algo.kl.estimator)
    kl_coef.observe(kl_value, len(batch))
    metrics = {
        **rollout_health([c for g in groups for c in g.completions], batch.scores, batch.group),
        **{k: v for k, v in result.stats.items() if k != "updates"},
        **critic_stats,
        "kl": kl_value,
        "beta": kl_coef.beta,
        "logprob_gap": logprob_gap(batch.rollout_logprobs, old, batch.response_mask),
        "invalid_rewards": float(len(dropped)),
        "completions": float(len(batch)),
        "rollout_kl": rollout_mismatch(batch.rollout_logprobs, old, batch.response_mask),
        **sample_lag(batch, result.version - 1),
        "policy_version": float(result.version - 1),
        **distill_metrics(old, scored.teacher_logprobs, batch.response_mask, teacher_seconds),
    }
    return StepStats(
        metrics,
        actions,
        result.version,
        tokens=float(batch.response_mask.sum()),
        attended=float(batch.attention_mask.sum()),
        seq_len=int(batch.input_ids.shape[1]),
    )


def trainable_batch(
    groups: list[Group], pad_id: int, guards: Guards | None
) -> tuple[TrainBatch, list[int]]:
    """The collated batch with the rows of invalid or non-finite rewards masked out (their
    scores still count in group statistics), and those rows."""
    batch = collate_groups(groups, pad_id)
    scores = batch.scores.tolist()
    nonfinite = guards.check_rewards(scores) if guards else []
    dropped = sorted(set(invalid_rows(groups)) | set(nonfinite))
    if not dropped:
        return batch, dropped
    log.warning(
        "guard nonfinite_reward: drop_samples - %d/%d invalid scores", len(dropped), len(batch)
    )
    mask = batch.response_mask.clone()
    mask[dropped] = 0.0  # a NaN / Inf reward never reaches the optimizer
    return replace(batch, response_mask=mask), dropped


def invalid_rows(groups: list[Group]) -> list[int]:
    """The rows (completions in group order) whose reward the scorer marked invalid."""
    return [r for r, bad in enumerate(b for g in groups for b in g.invalid or [False] * g.n) if bad]


def estimator_inputs(
    groups: list[Group], batch: TrainBatch, trainer: TrainerAPI, plan: StepPlan
) -> dict[str, torch.Tensor]:
    """The extra inputs the estimator's traits ask for, as ``plan`` holds them (see
    ``algos/advantages_extra.py``); ``batch`` already holds the old logprobs when the
    estimator takes them (the plan's ``sum_pi_squared``)."""
    inputs: dict[str, torch.Tensor] = {}
    if plan.components:
        terms = sorted({k for g in groups for k in g.components})
        rows = [
            [g.components.get(k, [math.nan] * g.n)[i] for k in terms]
            for g in groups
            for i in range(g.n)
        ]
        inputs["components"] = torch.tensor(rows, dtype=torch.float64).reshape(len(batch), -1)
    if plan.greedy_baseline:
        if any(g.baseline_score is None for g in groups):
            raise ValueError("the advantage estimator needs the rollout's greedy baselines")
        inputs["baseline_scores"] = torch.tensor(
            [g.baseline_score for g in groups for _ in range(g.n)], dtype=torch.float64
        )
    if plan.teacher:
        inputs["old_logprobs"] = batch.old_logprobs
        inputs["teacher_logprobs"] = batch.teacher_logprobs
    if plan.sum_pi_squared:
        if batch.old_logprobs is None:
            raise ValueError("the advantage estimator needs the old logprobs up front")
        inputs["old_logprobs"] = batch.old_logprobs
        inputs["sum_pi_squared"] = trainer.logprobs(batch, "sum_pi_squared")
    return inputs


def turn_rewards(groups: list[Group], response_mask: torch.Tensor) -> torch.Tensor | None:
    """The environments' per-turn rewards of multi-turn episodes, each on the last token of
    the policy turn that earned it: [B, T] float32 (None when no episode has one).

    Rows whose tokens are all masked (a dropped invalid reward) get none."""
    completions = [c for g in groups for c in g.completions]
    if not any(c.episode and any(t.reward for t in c.episode.turns) for c in completions):
        return None
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    for row, c in enumerate(completions):
        for t in c.episode.turns if c.episode else []:
            if t.role == "policy" and t.reward and t.end > t.start and response_mask[row].any():
                out[row, t.end - 1] += t.reward
    return out


def compute_advantages(
    batch: TrainBatch,
    algo: AlgoConfig,
    *,
    beta: float,
    inputs: dict | None = None,
    turn_rewards: torch.Tensor | None = None,
    bound: Callable | None = None,
) -> Advantages:
    """Token-level rewards (less the KL penalty), advantages and returns.

    ``beta``: the KL coefficient in the reward (:attr:`KLCoefficient.in_reward`, 0 when
    the KL is in the loss); ``inputs``: extra keyword inputs of the estimator (:func:`estimator_inputs`);
    ``turn_rewards`` [B, T]: per-turn rewards of episodes, added to the outcome scores'
    token rewards (outcome estimators sum them into the episode's return; GAE and
    return-to-go estimators see them where they were earned); ``bound``: the estimator
    already bound (:attr:`TrainSettings.estimator`), else ``algo.advantage``'s."""
    mask = batch.response_mask
    rewards = scores_to_token_rewards(batch.scores, mask)
    if turn_rewards is not None:
        rewards = rewards + turn_rewards.to(rewards.dtype)
    if batch.ref_logprobs is not None and beta > 0:
        old, ref, kl = batch.old_logprobs, batch.ref_logprobs, algo.kl.estimator
        rewards, _ = kl_penalized_rewards(rewards, old, ref, mask, beta=beta, estimator=kl)
    estimator = bound or bound_estimator(algo)
    values = {} if batch.values is None else {"values": batch.values}  # a critic's, when kept
    advantages, returns = estimator(rewards, mask, batch.group, **values, **(inputs or {}))
    return Advantages(rewards, advantages, returns)


def kl_to_reference(
    old: torch.Tensor | None, ref: torch.Tensor | None, mask: torch.Tensor, estimator: str
) -> float:
    """Mean per-token KL of the sampling policy (``old``) to the reference (the configured
    estimator); 0 without either."""
    if ref is None or old is None:
        return 0.0
    return float(masked_mean(get_kl_estimator(estimator)(old, ref), mask))


def rollout_mismatch(rollout: torch.Tensor, old: torch.Tensor | None, mask: torch.Tensor) -> float:
    """KL(engine || trainer) estimate on the sampled tokens: mean of ``rollout - old`` (k1)."""
    if old is None:
        return 0.0
    return float(masked_mean(rollout - old, mask))


def sample_lag(batch: TrainBatch, version: int) -> dict[str, float]:
    """Versions between the weights being trained and the oldest token of each sample.

    Read from the per-token versions the engines stamped (-1 on padding); a row
    without tokens counts as current."""
    v = batch.token_versions
    oldest = torch.where(v >= 0, v, torch.full_like(v, version)).min(dim=-1).values
    lags = (version - oldest).tolist() or [0]
    return {"sample_lag": sum(lags) / len(lags), "sample_lag_max": float(max(lags))}


def with_teacher(batch: TrainBatch, teacher, plan: StepPlan) -> tuple[TrainBatch, float]:
    """``batch`` with the teacher's logprobs of its responses (and its logits when the loss
    reads them), and the seconds the teacher took; as it was when the plan reads none."""
    if not (plan.teacher or plan.teacher_logits):
        return batch, 0.0
    if teacher is None:
        raise ValueError("the step plan distils from a teacher but the run built none")
    t0 = time.perf_counter()
    if plan.teacher_logits:
        logits = teacher.logits(batch)
        real = batch.attention_mask[:, batch.prompt_width :] > 0
        lp = torch.where(real, token_logprobs(logits, batch.responses), 0.0)
        batch = replace(batch, teacher_logits=logits, teacher_logprobs=lp)
    else:
        batch = replace(batch, teacher_logprobs=teacher.logprobs(batch))
    return batch, time.perf_counter() - t0


def distill_metrics(
    old: torch.Tensor | None, teacher: torch.Tensor | None, mask: torch.Tensor, seconds: float
) -> dict[str, float]:
    """``distill_kl`` (the sampling student's mean per-token reverse KL to the teacher on its
    own tokens) and ``teacher_seconds``; {} in a run without a teacher."""
    if teacher is None or old is None:
        return {}
    return {"distill_kl": distill_kl(old, teacher, mask), "teacher_seconds": seconds}
