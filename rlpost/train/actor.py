"""The policy trainer: PPO-style updates of the actor, algorithm-blind.

The trainer knows nothing of GRPO or PPO by name: it is handed the chosen policy loss
(``algo.loss``: a registered name and its parameters) and a KL estimator, and applies
them over epochs, shuffled mini-batches (one optimizer step each) and micro-batches
(gradient accumulation). What is decided once per mini-batch (the loss denominators,
:meth:`Aggregation.for_minibatch`; a token selector's choice) is a frozen
:class:`Minibatch`, so the accumulated gradient is the same however a mini-batch is
split. Each micro-batch's forward pass becomes one frozen
:class:`rlpost.algos.policy_losses.LossInputs`, holding what the loss declared it reads
(full logits and the teacher's for a distillation loss); the loss and the KL, NLL and
entropy terms (:mod:`rlpost.algos.policy_losses`) are functions of it. Statistics stay tensors
until the step ends and are read once per optimizer step.

Precision: weights and optimizer state are float32; ``bf16=True`` runs the
forward and backward under bfloat16 autocast (bf16 compute, fp32 master).

The weights' layout (:mod:`rlpost.train.layout`: plain, LoRA or sharded) says where
the reference comes from and how the rows are shared. Sharded (data parallel): every
rank is handed the whole batch, computes the denominators on the whole mini-batch as
above, and runs its share of the rows; gradients are summed over ranks, so the step
is one worker's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlpost.algos.aggregate import Aggregation
from rlpost.algos.correction import get_correction
from rlpost.algos.entropy import entropy_from_logits
from rlpost.algos.policy_losses import POLICY_LOSSES, LossInputs, entropy_term, kl_term, nll_term
from rlpost.config import OptimConfig
from rlpost.observe.mfu import default_cpu_peak_flops, flops_per_token
from rlpost.params import Variant
from rlpost.rng import derive
from rlpost.train.batch import (
    TrainBatch,
    compute_logprobs,
    model_device,
    pad_responses,
    response_logits,
    response_logprobs,
    response_sum_pi_squared,
    score_rows,
    token_logprobs,
)
from rlpost.train.layout import PlainLayout, WeightLayout
from rlpost.train.optim import (
    adamw,
    apply_grads,
    budget_slices,
    minibatch_updates,
    optimizer_step,
)
from rlpost.train.packing import SHARING_MODES, resolve_packing


@dataclass
class ActorSettings:
    optim: OptimConfig = field(default_factory=OptimConfig)  # its lr a number, not "auto"
    mini_batch_size: int = 64
    micro_batch_size: int = 64
    epochs: int = 1
    temperature: float = 1.0
    loss_agg_mode: str = "token-mean"
    norm_constant: float | None = None
    entropy_coef: float = 0.0
    nll_coef: float = 0.0
    bf16: bool = False
    logits_chunk: int = 0  # LM-head tokens per chunk (0: from the vocabulary; -1: full logits)
    max_tokens_per_micro_batch: int = 0  # padded tokens per micro-batch (0: rows only)
    packing: str = "off"  # auto | shared | on | off: rows packed end to end (train.packing)
    correction: Variant | None = None  # the chosen algo.rollout_correction (None: none)


@dataclass(frozen=True)
class Minibatch:
    """What is decided once per optimizer mini-batch, then sliced per micro-batch.

    ``agg``: the loss denominators; ``beta``: the KL term's coefficient; ``selected``
    ``[B, T]``: the tokens the loss's token selector chose (None: no selector);
    ``rewarded`` ``[B, 1]``: 1.0 for samples with score > 0, and ``nll_agg`` the
    token-mean over their tokens in the mini-batch (NLL term)."""

    agg: Aggregation
    beta: float = 0.0
    selected: torch.Tensor | None = None
    rewarded: torch.Tensor | None = None
    nll_agg: Aggregation | None = None

    def part(self, rows: torch.Tensor, width: int) -> Minibatch:
        """The rows ``rows`` (of the whole batch) and first ``width`` response columns."""
        selected = None if self.selected is None else self.selected[rows][:, :width]
        rewarded = None if self.rewarded is None else self.rewarded[rows]
        return replace(self, selected=selected, rewarded=rewarded)


@dataclass(frozen=True)
class PolicyUpdate:
    """What :meth:`PolicyTrainer.update` did: ``stats``, the means over its optimizer steps
    (``loss``, ``grad_norm``, ``clip_frac``, ``lr``...), and ``old_logprobs`` ``[B, T]``
    when they came from its own loss pass (None when the batch brought them)."""

    stats: dict[str, float]
    old_logprobs: torch.Tensor | None = None


ADDITIVE_STATS = frozenset({"pg_loss", "nll_loss", "entropy"})
"""Statistics that are shares of the mini-batch value (reduced with its denominators)."""


def warmup_lambda(warmup_steps: int):
    """LR multiplier: linear from 1/(w+1) to 1 over ``warmup_steps`` updates, then constant."""

    def fn(step: int) -> float:
        if warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return fn


@dataclass
class LRScale:
    """The guards' cuts of the LR: one factor on the whole schedule, saved with the
    trainer's state (a rollback to an older checkpoint may keep the cuts made since)."""

    factor: float = 1.0

    def cut(self, by: float) -> float:
        self.factor *= by
        return self.factor

    def state_dict(self) -> dict[str, float]:
        return {"factor": self.factor}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.factor = float(state["factor"])


def size_scaled_lr(parameters: int, adapters: bool = False) -> float:
    """``train.optim.lr=auto``: the policy's peak LR from its size, 1e-6 x (7e9 / parameters)
    ** 0.76 to two significant digits, ten times that for LoRA adapters: through the 1e-6
    GRPO runs settle on at 7B and SmolLM2-135M's 2e-5, which gained +22.5 held-out points in
    20 steps of a new task where 1e-5 gained +13.5 (docs/models.md); 0.5B gets 7.5e-6."""
    lr = 1e-6 * (7e9 / max(parameters, 1)) ** 0.76 * (10.0 if adapters else 1.0)
    return float(f"{lr:.2g}")


def build_optimizer(model: torch.nn.Module, s: ActorSettings, scale: LRScale | None = None):
    """AdamW over the trainable parameters; the LR is ``s.optim.lr`` x warm-up x ``scale``."""
    opt = adamw([p for p in model.parameters() if p.requires_grad], s.optim)
    warmup = warmup_lambda(s.optim.warmup_steps)
    scale = scale if scale is not None else LRScale()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup(step) * scale.factor)
    return opt, sched


EAGER_ATTENTION_MAX_POSITIONS = 512


def eager_attention_pays(model) -> bool:
    """Whether the trainer should run the eager attention rather than sdpa under bf16.

    On CPU, torch's sdpa backward under bf16 autocast is slow at the short sequences of
    RL on small models: eager attention made a bf16 forward+backward 1.34x faster at
    ~25M and 1.44x at the tiny size (128 rows x 16 tokens, docs/performance.md); in
    fp32 the two are even. Eager keeps a ``[B, heads, L, L]`` score tensor per layer
    for the backward, so it is used only where the context is short. A bf16 engine takes
    the same kernel (:func:`rlpost.rollout.engines.hf.serving_copy`)."""
    positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return positions <= EAGER_ATTENTION_MAX_POSITIONS and hasattr(model, "set_attn_implementation")


def bf16_autocast(model: torch.nn.Module, bf16: bool):
    """bfloat16 autocast on ``model``'s device when ``bf16``, else no change."""
    if bf16:
        return torch.autocast(model_device(model).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class PolicyTrainer:
    """Updates ``model`` from :class:`TrainBatch` es with ``loss``, the chosen variant of
    ``algo.loss`` (a registered name and its parameters)."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: Variant,
        settings: ActorSettings,
        *,
        layout: WeightLayout | None = None,
        kl_estimator=None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.layout = layout if layout is not None else PlainLayout(model)
        self.ranks = self.layout.ranks  # how a batch's rows are shared (one rank, or DP)
        self.loss, self.policy_loss = loss, POLICY_LOSSES.get(loss.name)
        # What the loss declared it reads beyond the logprobs. A loss that treats tokens chosen
        # over the whole batch (KL-Cov, Clip-Cov) gets its choice made once per mini-batch
        # here, so micro-batch splits cannot change it.
        self.token_selector = POLICY_LOSSES.trait(loss.name, "token_selector", None)
        self.full_logits = bool(POLICY_LOSSES.trait(loss.name, "needs_teacher_logits"))
        self.kl_estimator = kl_estimator
        c = settings.correction
        self.correction = None if c is None or c.name == "none" else get_correction(c.name)
        self.s = settings
        self.agg = Aggregation(settings.loss_agg_mode, norm_constant=settings.norm_constant)
        self.nll_agg = Aggregation("token-mean")  # the NLL term's, over rewarded rows
        # Decided once: the rows of every pass run packed, or padded where the model cannot.
        # (ranks that split the model, not the rows, run every row: they pack as one does)
        self.packed = resolve_packing(settings.packing, model, sharded=self.ranks.world > 1)
        self.whole_groups = settings.packing in SHARING_MODES  # mini-batches of whole groups
        self.lr_scale = LRScale()
        self.optimizer, self.scheduler = build_optimizer(model, settings, self.lr_scale)
        self.shuffle = torch.Generator().manual_seed(derive(seed, "actor_shuffle"))
        self.skipped_updates = 0

    def _rows(self, fn, batch: TrainBatch) -> torch.Tensor:
        """``fn(batch)``, or under data parallelism each rank's share gathered (on CPU)."""
        return self.ranks.map_rows(batch, fn).cpu()

    def old_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._rows(lambda b: self._logprobs(self.model, b), batch)

    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        with bf16_autocast(self.model, self.s.bf16):
            return compute_logprobs(
                model,
                batch,
                temperature=self.s.temperature,
                micro_batch_size=self.s.micro_batch_size,
                chunk=self.s.logits_chunk,
                max_tokens=self.s.max_tokens_per_micro_batch,
                packed=self.packed,
            )

    @property
    def has_reference(self) -> bool:
        return self.layout.has_reference

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if not self.layout.has_reference:
            return None
        with self.layout.reference() as ref:
            return self._rows(lambda b: self._logprobs(ref, b), batch)

    def sum_pi_squared(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` ``sum_v pi(v)^2`` of the policy (at the sampling temperature) at each
        response position; the optimal token baseline's path-variance input."""
        return self._rows(self._sum_pi_squared, batch)

    @torch.no_grad()
    def _sum_pi_squared(self, batch: TrainBatch) -> torch.Tensor:
        def fn(mb: TrainBatch) -> torch.Tensor:
            with bf16_autocast(self.model, self.s.bf16):
                return response_sum_pi_squared(
                    self.model,
                    mb,
                    self.s.temperature,
                    chunk=self.s.logits_chunk,
                    packed=self.packed,
                )

        return score_rows(
            self.model,
            batch,
            fn,
            micro_batch_size=self.s.micro_batch_size,
            max_tokens=self.s.max_tokens_per_micro_batch,
            packed=self.packed,
        )

    def single_update(self, batch_size: int) -> bool:
        """True when a batch makes exactly one optimizer step (one epoch, one mini-batch).

        Then the policy that computes the loss is the one that sampled, so the
        old logprobs may be the loss pass's own (detached) and a separate forward
        pass over the batch is skipped (``update`` returns them)."""
        return self.s.epochs == 1 and self.s.mini_batch_size >= batch_size

    def update(self, batch: TrainBatch, *, beta: float = 0.0) -> PolicyUpdate:
        """Epochs x mini-batches of optimizer steps on ``batch`` (which is left as it was).

        Needs ``batch.advantages``; ``batch.old_logprobs`` may be None only when
        :meth:`single_update` holds and no token selector reads them first: the loss
        pass's own are then used and returned in the result."""
        if batch.advantages is None:
            raise ValueError("update() needs batch.advantages")
        own_old = batch.old_logprobs is None
        if own_old and not self.single_update(len(batch)):
            raise ValueError(
                "update() needs batch.old_logprobs when it makes more than one optimizer step"
            )
        if own_old and self.token_selector is not None:
            raise ValueError("update() needs batch.old_logprobs: the token selector reads them")
        if own_old:  # the trainer's own record, filled row by row from the loss pass
            batch = replace(batch, old_logprobs=torch.zeros_like(batch.response_mask))
        self.model.train()
        on_device = batch.to(model_device(self.model))
        out = minibatch_updates(
            len(batch),
            self.s.mini_batch_size,
            self.s.epochs,
            self.shuffle,
            lambda rows: self._step(on_device, rows, beta, own_old),
            groups=batch.group if self.whole_groups else None,
        )
        if own_old:
            self.layout.rows_filled(on_device.old_logprobs)
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return PolicyUpdate(out, on_device.old_logprobs.cpu() if own_old else None)

    def _step(
        self, batch: TrainBatch, rows: torch.Tensor, beta: float, fill_old: bool
    ) -> dict[str, float]:
        """One optimizer step on rows ``rows`` of ``batch`` (micro-batches accumulated)."""
        outcome = optimizer_step(
            self.optimizer,
            self.scheduler,
            self._params(),
            self.s.optim.grad_clip,
            self._micros(batch, rows),
            self._micro_loss(batch, rows, beta, fill_old),
            lambda stats: self.ranks.sum_floats({k: float(v) for k, v in stats.items()}),
            self.layout.accumulate,
        )
        if outcome.skipped:
            self.skipped_updates += 1
        return {**outcome.as_dict(), "loss": outcome.loss}

    def accumulate(
        self,
        batch: TrainBatch,
        loss: tuple | None = None,
        *,
        agg: str | None = None,
        record: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """The gradients of ``loss`` over all of ``batch``, added to the trainable parameters'
        (no optimizer step: :meth:`apply_step` takes it). ``loss``: (function, params) in place
        of the trainer's own; ``agg``: its reduction in place of the trainer's; ``record``:
        ``[B, T]`` that receives the pass's logprobs; ``batch.old_logprobs`` None: the pass's
        own (ratio 1)."""
        if batch.advantages is None:
            raise ValueError("accumulate() needs batch.advantages")
        fill_old = batch.old_logprobs is None
        if fill_old:
            batch = replace(batch, old_logprobs=torch.zeros_like(batch.response_mask))
        self.model.train()
        batch, rows = batch.to(model_device(self.model)), torch.arange(len(batch))
        micro_loss = self._micro_loss(batch, rows, 0.0, fill_old, loss, agg, record)
        total, stats = self.layout.accumulate(self._micros(batch, rows), micro_loss)
        return {**{k: float(v) for k, v in stats.items()}, "loss": total}

    def apply_step(self, grad_clip: float) -> dict[str, float]:
        """Clip and apply the accumulated gradients (skipped when non-finite), then zero them."""
        outcome = apply_grads(self.optimizer, self.scheduler, self._params(), grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_updates += outcome.skipped
        return outcome.as_dict()

    def _params(self) -> list[torch.nn.Parameter]:
        # The optimizer's own tensors: a sharded model lists its gathered (unsharded)
        # parameters between a forward and the next reshard, and those get no gradient.
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _micros(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        budget = self.s.max_tokens_per_micro_batch
        if budget > 0:  # one rank (a rule refuses it with data-parallel trainers)
            return budget_slices(
                rows,
                *batch.lengths(),
                self.s.micro_batch_size,
                budget,
                packed=self.packed,
                groups=self.packed.groups(batch),
            )
        return self.ranks.micro_slices(rows, self.s.micro_batch_size)

    def _micro_loss(
        self, batch, rows, beta: float, fill_old: bool, loss=None, agg=None, record=None
    ):
        """The loss and statistics of one micro-batch of rows ``rows`` of ``batch``; the
        pass's logprobs go to ``record`` (``batch.old_logprobs`` when ``fill_old``)."""
        mb = self._minibatch(batch, rows, beta, agg)
        record = batch.old_logprobs if fill_old else record
        total_tokens = float(batch.response_mask[rows].sum().clamp(min=1))

        def micro_loss(micro_rows: torch.Tensor):
            micro = self.ranks.select(batch, micro_rows)  # padding rows (PAD) carry a zero mask
            if self.s.max_tokens_per_micro_batch > 0:  # this micro-batch's own widths
                micro = micro.trimmed()
            x, fixed = self._inputs(
                micro, fill_old, mb.part(micro_rows.clamp(min=0), micro.responses.shape[1])
            )
            value, stats = self._loss(x, mb.beta, loss)
            stats |= fixed
            if record is not None:
                real = micro_rows >= 0
                seen = pad_responses(x.logprobs.detach(), batch.responses.shape[1])
                record[micro_rows[real]] = seen[real]
            # Loss terms reduced with the mini-batch denominators add up over micro-batches
            # (and ranks); per-micro-batch means are weighted by their share of the tokens.
            weight = float(micro.response_mask.sum()) / total_tokens
            stats = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in stats.items()}
            return value, {k: v if k in ADDITIVE_STATS else v * weight for k, v in stats.items()}

        return micro_loss

    def _minibatch(
        self, batch: TrainBatch, rows: torch.Tensor, beta: float, agg: str | None = None
    ) -> Minibatch:
        """The loss denominators and what else is decided once per mini-batch."""
        mask = batch.response_mask[rows]
        agg = (self.agg if agg is None else Aggregation(agg)).counts(mask)
        selected = rewarded = nll_agg = None
        if self.token_selector is not None:
            chosen = self.token_selector(
                batch.old_logprobs[rows], batch.advantages[rows], mask, self.loss
            )
            selected = torch.zeros_like(batch.response_mask, dtype=torch.bool)
            selected[rows] = chosen
        if self.s.nll_coef > 0:
            rewarded = (batch.scores > 0).to(batch.response_mask.dtype)[:, None]
            nll_agg = self.nll_agg.counts(mask * rewarded[rows])
        return Minibatch(agg, beta, selected, rewarded, nll_agg)

    def _inputs(
        self, micro: TrainBatch, fill_old: bool, mb: Minibatch
    ) -> tuple[LossInputs, dict[str, torch.Tensor]]:
        """The micro-batch's forward pass and the inputs its loss terms read (the full
        ``[B, T, V]`` logits and the teacher's when the loss declared it needs them), with
        the rollout correction's statistics."""
        logits = None
        with bf16_autocast(self.model, self.s.bf16):
            if self.full_logits:
                logits = response_logits(self.model, micro)
            else:
                logprobs, entropy = response_logprobs(
                    self.model,
                    micro,
                    self.s.temperature,
                    with_entropy=self.s.entropy_coef > 0,
                    chunk=self.s.logits_chunk,
                    packed=self.packed,
                )
        if logits is not None:
            logprobs = token_logprobs(logits, micro.responses, self.s.temperature)
            entropy = entropy_from_logits(logits.float()) if self.s.entropy_coef > 0 else None
        old = logprobs.detach() if fill_old else micro.old_logprobs
        advantages, fixed = micro.advantages, {}
        if self.correction is not None and micro.rollout_logprobs is not None:
            # The proximal policy is old_logprobs: the loss pass's own with one optimizer
            # step per batch (no extra forward pass), else the recompute before the first.
            fix = self.correction(
                old, micro.rollout_logprobs, micro.response_mask, self.s.correction
            )
            advantages, fixed = advantages * fix.weights, fix.stats
        x = LossInputs(
            logprobs,
            old,
            advantages,
            micro.response_mask,
            mb.agg,
            rollout_logprobs=micro.rollout_logprobs,
            ref_logprobs=micro.ref_logprobs,
            selected=mb.selected,
            logits=logits,
            teacher_logits=micro.teacher_logits,
            entropy=entropy,
            rewarded=mb.rewarded,
            nll_agg=mb.nll_agg,
        )
        return x, fixed

    def _loss(
        self, x: LossInputs, beta: float, loss: tuple | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss (``loss``'s (function, params), else the trainer's) plus each term
        whose coefficient is not 0; detached statistics."""
        fn, params = loss if loss is not None else (self.policy_loss, self.loss)
        out = fn(x, params)
        loss, stats = out.loss, {**out.stats, "pg_loss": out.loss.detach()}
        kl = beta if x.ref_logprobs is not None else 0.0
        terms = (  # (statistic, coefficient, term); the pipeline logs the KL itself
            (None, kl, lambda: kl_term(x, self.kl_estimator)),
            ("nll_loss", self.s.nll_coef, lambda: nll_term(x)),
            ("entropy", -self.s.entropy_coef, lambda: entropy_term(x)),  # a bonus
        )
        for name, coef, term in terms:
            if coef != 0:
                value = term()
                loss = loss + coef * value
                stats |= {name: value.detach()} if name else {}
        return loss, stats

    def mfu_of(self, tokens: float, seq: int, seconds: float) -> float:
        """Model FLOPs utilisation of the train phase of a step (old/ref passes + updates)
        over ``tokens`` non-padding tokens in sequences padded to ``seq``.

        Counted FLOPs: one forward (2N) per scoring pass (old, and ref when kept)
        plus forward+backward (6N) per epoch, per token, over the peak FLOP/s of
        this device (a one-off matmul probe on CPU)."""
        if seconds <= 0:
            return 0.0
        if model_device(self.model).type != "cpu":  # the peak measured here is the CPU's
            return math.nan
        cfg = self.model.config
        n_params = sum(p.numel() for n, p in self.model.named_parameters() if "embed" not in n)
        fwd, train = (
            flops_per_token(n_params, cfg.num_hidden_layers, cfg.hidden_size, seq, training=t)
            for t in (False, True)
        )
        passes = 1 + self.has_reference
        return (passes * fwd + self.s.epochs * train) * tokens / seconds / default_cpu_peak_flops()

    def scale_lr(self, factor: float) -> float:
        """Multiply the LR schedule by ``factor`` (used by guards); returns the new peak LR."""
        self.lr_scale.cut(factor)
        self._apply_lr()
        return self.scheduler.base_lrs[0] * self.lr_scale.factor

    def _apply_lr(self) -> None:
        """The schedule's value now, in the optimizer (the next update uses it)."""
        step = self.scheduler.last_epoch
        for g, base, fn in zip(
            self.optimizer.param_groups,
            self.scheduler.base_lrs,
            self.scheduler.lr_lambdas,
            strict=True,
        ):
            g["lr"] = base * fn(step)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (in the layout's form), schedule, LR scale, shuffle generator."""
        return {
            "optimizer": self.layout.optimizer_state(self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "lr_scale": self.lr_scale.state_dict(),
            "shuffle": self.shuffle.get_state(),
            "skipped_updates": self.skipped_updates,
        }

    def load_state_dict(self, state: dict[str, Any], *, keep_lr_scale: bool = False) -> None:
        """What :meth:`state_dict` returned; ``keep_lr_scale``: the LR cuts made since that
        state stay (a guard's rollback). A state without ``lr_scale`` holds its cuts in the
        schedule's own peaks, and loads with a factor of 1."""
        self.layout.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle.set_state(state["shuffle"])
        self.skipped_updates = int(state["skipped_updates"])
        if keep_lr_scale:  # the optimizer's LR came from the state: the cuts apply now too
            self._apply_lr()
        else:
            self.lr_scale.load_state_dict(state.get("lr_scale", {"factor": 1.0}))
