"""One offline step loop: SFT, chat SFT, DPO and the reward model are objectives it runs.

    rows --objective.draw(rng)--> a step's micro-batches --objective.loss--> AdamW step
         (linear warm-up then cosine to a tenth, grad clip, accumulation, a non-finite
         step skipped) --every save_every--> STATE_DIR/checkpoints/step_N --> on_step(row)

An objective says how a step's micro-batches are drawn from its rows and what each one's
loss is (the math is in :mod:`rlpost.algos`); the loop owns the optimizer, the schedule,
clipping, accumulation and resume. A checkpoint is the RL run's format
(:func:`~rlpost.train.checkpoint.save_checkpoint`): ``model/`` (an HF directory),
``trainer_state.pt`` (optimizer, scheduler) and ``state.pt`` (losses, the data RNG, the
global RNGs and what the caller adds), so every command resumes the same way and a resumed
run takes exactly the steps of one that never stopped.
"""

from __future__ import annotations

import math
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rlpost.config import OptimConfig
from rlpost.rng import set_rng_state
from rlpost.statefile import fresh_dir, fsync_dir, fsync_tree, load_state, save_state
from rlpost.train.actor import warmup_lambda
from rlpost.train.checkpoint import TRAINER_STATE, latest_step, save_checkpoint, usable_checkpoint
from rlpost.train.optim import adamw, optimizer_step


class Objective(Protocol):
    def draw(self, rng: random.Random, batch_size: int) -> Sequence[Any]:
        """The micro-batches of one step, its rows drawn with ``rng``."""

    def loss(self, model: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """A micro-batch's share of the step's loss, and its share of the statistics."""


@dataclass(frozen=True)
class Schedule:
    """Steps, rows per step and the optimizer of one offline run (``save_every`` 0: save
    only when stopped)."""

    steps: int
    batch_size: int
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    save_every: int = 0


class TrainingStopped(KeyboardInterrupt):
    """The run stopped on request after ``step`` steps; its checkpoint is saved for a resume."""

    def __init__(self, step: int, state_dir: Path | None) -> None:
        super().__init__(f"training stopped after step {step}")
        self.step, self.state_dir = step, state_dir


def train_offline(
    model: torch.nn.Module,
    objective: Objective,
    s: Schedule,
    *,
    state_dir: Path | None = None,
    tokenizer=None,
    stop: Callable[[], bool] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    keep: dict[str, Any] | None = None,
) -> list[float]:
    """Train ``model`` in place for ``s.steps`` steps; returns every step's loss.

    Resumes from ``state_dir``'s newest checkpoint when it holds one. When ``stop()`` turns
    true a checkpoint is saved and :class:`TrainingStopped` raised. ``keep``: caller state
    written into each checkpoint (read back with :func:`saved_state`). ``on_step(step,
    row)`` gets the 1-based step and ``loss``, ``grad_norm``, ``skipped``, ``lr`` and the
    objective's statistics."""
    params = list(model.parameters())
    opt = adamw(params, s.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_then_cosine(s.optim.warmup_steps, s.steps)
    )
    rng, losses = random.Random(s.seed), []
    ckpt = usable_checkpoint(state_dir) if state_dir is not None else None
    if ckpt is not None:
        losses = _restore(ckpt, model, opt, sched, rng)

    def save() -> None:
        if state_dir is not None:
            _save(state_dir, len(losses), model, tokenizer, opt, sched, rng, losses, keep)

    model.train()
    first = len(losses)
    for step in range(first, s.steps):
        if stop is not None and stop():
            save()
            raise TrainingStopped(step, state_dir)
        if s.save_every and step > first and step % s.save_every == 0:
            save()
        micro = objective.draw(rng, s.batch_size)
        lr = opt.param_groups[0]["lr"]
        out = optimizer_step(
            opt, sched, params, s.optim.grad_clip, micro, lambda m: objective.loss(model, m)
        )
        losses.append(out.loss)
        if on_step is not None:
            on_step(step + 1, {"loss": out.loss, **out.as_dict(), "lr": lr})
    model.eval()
    return losses


def _save(state_dir, step, model, tokenizer, opt, sched, rng, losses, keep) -> None:
    def parts(directory: Path) -> None:
        model.save_pretrained(directory / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(directory / "model")
        trainer = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        save_state(trainer, directory / TRAINER_STATE)

    state = {"losses": losses, "data_rng": rng.getstate(), "keep": keep or {}}
    save_checkpoint(state_dir, step, parts, state)


def _restore(ckpt: Path, model, opt, sched, rng: random.Random) -> list[float]:
    saved = type(model).from_pretrained(ckpt / "model", torch_dtype=next(model.parameters()).dtype)
    model.load_state_dict(saved.state_dict())
    trainer = load_state(ckpt / TRAINER_STATE)
    opt.load_state_dict(trainer["optimizer"])
    sched.load_state_dict(trainer["scheduler"])
    state = load_state(ckpt / "state.pt")
    rng.setstate(state["data_rng"])
    set_rng_state(state["rng"])
    return list(state["losses"])


def saved_state(state_dir: Path) -> dict[str, Any] | None:
    """What the caller kept in ``state_dir``'s newest checkpoint (None: no checkpoint)."""
    ckpt = usable_checkpoint(state_dir)
    return None if ckpt is None else load_state(ckpt / "state.pt")["keep"]


def steps_done(state_dir: Path) -> int:
    """Steps the newest checkpoint in ``state_dir`` holds (0: none saved)."""
    return latest_step(usable_checkpoint(state_dir)) if state_dir.is_dir() else 0


def save_model(model, tokenizer, out: Path, state_dir: Path | None = None) -> None:
    """Write the finished model to ``out`` atomically and durably, then remove its resume
    state: a crash at any point leaves either the checkpoint to continue from or the
    whole model, never a half-written model the loader trips on."""
    tmp = fresh_dir(out.with_name(f".{out.name}.tmp"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    fsync_tree(tmp)
    tmp.rename(out)
    fsync_dir(out.parent)
    if state_dir is not None and state_dir.exists():
        shutil.rmtree(state_dir)  # our own resume state, superseded by the finished model


def warmup_then_cosine(warmup_steps: int, total: int) -> Callable[[int], float]:
    """LR multiplier: :func:`~rlpost.train.actor.warmup_lambda` for ``warmup_steps``, then a
    cosine from 1 to 0.1 at ``total``."""
    warm = warmup_lambda(warmup_steps)

    def fn(step: int) -> float:
        if step < warmup_steps:
            return warm(step)
        progress = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


def pair_parts(rng: random.Random, n: int, batch_size: int, micro: int) -> list[tuple]:
    """One step of preference pairs: ``batch_size`` of ``n`` drawn without replacement, cut
    into ``(pairs, pairs in the step)`` micro-batches of ``micro`` pairs."""
    idx = rng.sample(range(n), min(batch_size, n))
    return [(idx[lo : lo + micro], len(idx)) for lo in range(0, len(idx), micro)]
