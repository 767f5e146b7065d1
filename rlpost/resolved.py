"""Derived run facts: what follows from the config and the registries, decided once.

:func:`resolve` turns a config into a frozen :class:`RunFacts` (device, dtype, the engine and its
traits, storage sharing, a kept reference, the :class:`StepPlan`, the :class:`TrainerLayout`);
builders, the rule table, the memory estimate and the cluster read it and decide none of it again.
Engines register in ``ENGINES`` from their modules in ``rollout/`` with the traits read here:
``loads_own_weights`` (vLLM, servers), ``over_http`` (servers the weight path pushes to),
``whole_batches`` (no early stop, no weights mid-generation), ``shares_storage`` (may serve the
policy's own parameter memory).

The step plan (logprob passes, reference, critic, estimator inputs) comes from the algorithms'
registered traits, never from the batch. Old logprobs come from the engine (``rollout``), a trainer
pass before the update (``pass``), or a single update's own loss pass (``update``;
:meth:`StepPlan.old_source`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlpost.algos import ADVANTAGES, POLICY_LOSSES
from rlpost.config import ClusterConfig, Config, ConfigError
from rlpost.observe.mfu import cpu_bf16_native
from rlpost.registry import Registry
from rlpost.sync.codecs import CODECS

OldSource = Literal["rollout", "pass", "update"]


@dataclass(frozen=True)
class StepPlan:
    """What every train step of a run computes, and where each input comes from.

    ``old_logprobs``: ``rollout`` (the engine's) or ``trainer`` (:meth:`old_source` says which
    trainer pass). ``single_update_rows``: the largest batch one optimizer step covers
    (``train.mini_batch_size`` with one epoch, else 0). ``reference``: a reference pass (a KL
    penalty, or a loss that reads ``ref_logprobs``). ``values``: critic values and a critic update
    (the estimator needs a critic). ``components``, ``greedy_baseline``, ``sum_pi_squared``:
    estimator inputs its traits ask for. ``kl_in_reward``: the KL penalty is subtracted from the
    rewards (else added to the loss). ``token_selector``: the loss picks tokens by the old logprobs
    before its first step. ``critic_warmup_steps``: steps the critic trains alone."""

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

    @property
    def reads_teacher(self) -> bool:
        """Whether a step reads a teacher (its logprobs or its logits)."""
        return self.teacher or self.teacher_logits

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


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer ranks as data-parallel ``dp`` x pipeline stages ``pp`` x tensor-parallel ``tp``
    (``cluster.trainer_workers``, ``pipeline_parallel``, ``tensor_parallel``): the shape of the
    device mesh, in that order, neighbours in rank order sharing a layer. :meth:`of` is the one
    place that checks the sizes fit; the mesh, the builders and the memory estimate read the record.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def split(self) -> bool:
        """Whether a rank holds part of a layer or of the layers (a mesh beyond data parallel)."""
        return self.pp * self.tp > 1

    @classmethod
    def of(cls, c: ClusterConfig) -> TrainerLayout:
        """The layout of ``c``; ConfigError (one line) when ``pp x tp`` does not divide the
        workers."""
        n, pp, tp = c.trainer_workers, c.pipeline_parallel, c.tensor_parallel
        if n % (pp * tp):
            split = (("pipeline_parallel", pp), ("tensor_parallel", tp))
            parts = " x ".join(f"cluster.{k}={v}" for k, v in split if v > 1)
            raise ConfigError(
                f"{parts} does not divide cluster.trainer_workers={n}; set trainer_workers to a "
                f"multiple of {pp * tp} (data-parallel x pipeline stages x tensor-parallel)"
            )
        return cls(n // (pp * tp), pp, tp)


ENGINES: Registry = Registry("rollout engine")
"""Registered engine name -> ``builder(cfg, facts, model, tokenizer) -> RolloutEngine``."""


@dataclass(frozen=True)
class RunFacts:
    """What a run's config and registries imply. ``device``: ``run.device`` resolved. ``bf16``:
    ``model.dtype`` resolved. ``engine``: the registered engine that serves rollouts;
    ``engine_in_process``: from this process's memory (a weights copy, a KV cache);
    ``engine_over_http``: from servers. ``shares_storage``: the serving module is the policy's own
    parameter memory. ``adapters``: LoRA adapters train (``model.lora.rank > 0``); then the
    reference is the base with the adapters off, else a frozen copy. ``group_relative``: the
    estimator compares the samples of a prompt. ``backend``: ``cluster.backend`` resolved (auto:
    local for one worker of each role in sync mode). ``layout``: the trainer ranks'
    :class:`TrainerLayout`."""

    device: Literal["cpu", "cuda"]
    bf16: bool
    engine: str
    engine_in_process: bool
    engine_over_http: bool
    shares_storage: bool
    adapters: bool
    group_relative: bool
    backend: Literal["local", "process", "ray"]
    plan: StepPlan
    layout: TrainerLayout = TrainerLayout()

    @property
    def reference_copy(self) -> bool:
        """Whether the trainer holds a frozen reference copy of the weights."""
        return self.plan.reference and not self.adapters


def resolve(cfg: Config) -> RunFacts:
    """The :class:`RunFacts` of ``cfg`` (the engines of ``rlpost.rollout`` registered);
    ConfigError when its trainer layout does not fit (:meth:`TrainerLayout.of`)."""
    device, c = cfg.run.device, cfg.cluster
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16, engine, plan = _bf16(cfg.model.dtype, device), _engine(cfg), resolve_step_plan(cfg)
    one = cfg.pipeline.mode == "sync" and c.trainer_workers == 1 and c.rollout_workers == 1
    return RunFacts(
        device=device,
        bf16=bf16,
        engine=engine,
        engine_in_process=not ENGINES.trait(engine, "loads_own_weights"),
        engine_over_http=bool(ENGINES.trait(engine, "over_http")),
        shares_storage=_shares_storage(cfg, engine, bf16),
        adapters=cfg.model.lora.rank > 0,
        group_relative=bool(ADVANTAGES.trait(cfg.algo.advantage.name, "group_relative")),
        backend=c.backend if c.backend != "auto" else "local" if one else "process",
        plan=plan,
        layout=TrainerLayout.of(c),
    )


def _bf16(dtype: str, device: str) -> bool:
    """``auto``: bf16 on a CPU with native bf16 instructions or a GPU that computes in it."""
    if dtype != "auto":
        return dtype == "bfloat16"
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_native()


def _engine(cfg: Config) -> str:
    """``rollout.engine``; ``auto``: continuous batching where a step stops early (partial),
    takes weights while it generates (async) or serves a harness, else batch decoding."""
    if not ENGINES.names():  # a bug, not a config error: the engine modules were not imported
        raise RuntimeError("no rollout engine is registered: import rlpost.rollout first")
    name = cfg.rollout.engine.name
    if name != "auto":
        return name
    continuous = cfg.rollout.partial or cfg.pipeline.mode == "async"
    return "hf_continuous" if continuous or cfg.agent.harness.name != "none" else "hf"


def _shares_storage(cfg: Config, engine: str, bf16: bool) -> bool:
    """Whether the in-process engine can serve the policy's own memory: when every sync writes the
    values already there (``copy_`` onto itself is a no-op). Synchronous steps, a sync every step,
    no codec or delta, no adapters (merged weights are not the base), fp32 serving (bf16 is its own
    cast copy), an engine that never generates across a sync."""
    s = cfg.sync
    return (
        cfg.pipeline.mode == "sync"
        and s.every == 1
        and CODECS.trait(s.codec.name, "identity")
        and not s.delta
        and cfg.model.lora.rank == 0
        and bool(ENGINES.trait(engine, "shares_storage"))
        and not bf16
    )
