"""Supervised fine-tuning: the warm-up that produces a starting policy.

No pretrained model can be downloaded, so the default job first teaches the
tiny model the task's format and some of its content with a short SFT stage on
the *training* split (never the held-out one). Targets are ``str(answer)`` plus
EOS; the loss is the token-mean negative log-likelihood of the target tokens.
``distractor`` replaces a fraction of targets with a systematically wrong
rendering of the right answer (its digits reversed: 27 -> "72"). The warm-up
policy then behaves like a pretrained model on a new task: it can produce the
right answer but does not reliably choose to, and RL on the verifiable reward is
what selects the right behaviour. Set it to 0 for plain SFT.
"""

from __future__ import annotations

import functools
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rlpost.statefile import fsync_dir, fsync_tree, load_state, save_state
from rlpost.train.actor import warmup_lambda
from rlpost.train.batch import model_device
from rlpost.train.optim import SlicedAdamW, optimizer_step
from rlpost.train.sft_chat import micro_batches, nll
from rlpost.types import Completion, Prompt


def reverse_digits(answer: object) -> str:
    """``27 -> "72"``, ``-31 -> "-13"``: the distractor rendering of an integer answer."""
    text = str(answer)
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    return sign + digits[::-1]


def sft_example(
    prompt: Prompt, tokenizer, rng: random.Random, distractor: float, encode: Callable
) -> Completion:
    """``encode(text)``: the token ids of ``text`` (no special tokens)."""
    text = str(prompt.answer)
    if distractor > 0 and isinstance(prompt.answer, int) and rng.random() < distractor:
        text = reverse_digits(prompt.answer)
    target = [*encode(text), tokenizer.eos_token_id]
    ids = list(encode(prompt.text))
    return Completion(ids, target, [0.0] * len(target), "stop", 0, 0)


class WarmupInterrupted(KeyboardInterrupt):
    """The warm-up stopped on request after ``step`` steps; its state is saved for a resume."""

    def __init__(self, step: int, state_dir: Path | None) -> None:
        super().__init__(f"warm-up stopped after step {step}")
        self.step, self.state_dir = step, state_dir


def resumable_steps(
    steps: int, state_dir: Path | None, save_every: int, stop, model, opt, sched, rng, losses
) -> Iterator[int]:
    """The steps after the ``losses`` already taken, up to ``steps``. Before each, the state
    is saved to ``state_dir`` every ``save_every`` steps (a kill loses at most that many) and,
    when ``stop()`` turns true, saved once more and :class:`WarmupInterrupted` raised."""
    first = len(losses)
    for step in range(first, steps):
        if stop is not None and stop():
            if state_dir is not None:
                save_train_state(state_dir, model, opt, sched, rng, losses)
            raise WarmupInterrupted(step, state_dir)
        if state_dir is not None and save_every and step > first and step % save_every == 0:
            save_train_state(state_dir, model, opt, sched, rng, losses)
        yield step


def sft_train(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[Prompt],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    warmup_steps: int = 0,
    seed: int = 0,
    distractor: float = 0.0,
    on_step: Callable[[int, float], None] | None = None,
    state_dir: Path | None = None,
    stop: Callable[[], bool] | None = None,
    example: Callable[[Prompt, random.Random], Completion | None] | None = None,
    save_every: int = 0,
    grad_clip: float = 1.0,
    max_tokens_per_micro_batch: int = 0,
) -> list[float]:
    """Train ``model`` in place for ``steps`` steps; returns the loss of each step.

    When ``stop()`` turns true the current step finishes, the warm-up state (weights,
    optimizer, scheduler, data RNG, losses) is saved to ``state_dir`` and
    :class:`WarmupInterrupted` is raised; a later call with the same ``state_dir``
    continues from there exactly. The state is also saved every ``save_every`` steps (0:
    only on a stop), so a kill loses at most that many. It is kept when the warm-up ends:
    the caller removes it once the finished model is safely written (:func:`save_model`).
    Each step is the shared :func:`~rlpost.train.optim.optimizer_step` (gradient clipped at
    ``grad_clip``, a non-finite step skipped). ``example(prompt, rng)`` builds a target in place of :func:`sft_example` (a multi-turn
    demonstration whose tool output is masked); None falls back to the plain target.
    ``max_tokens_per_micro_batch`` > 0 cuts a step's rows into micro-batches of at most that
    many padded tokens (the step's loss is the same whatever the cut).
    """
    opt, sched, rng, losses = start_train_state(model, lr, warmup_steps, steps, seed, state_dir)
    # Every step draws from the same prompts: tokenising each text once is a fifth of a
    # tiny model's warm-up saved.
    encode = functools.lru_cache(maxsize=1 << 16)(
        lambda t: tuple(tokenizer(t, add_special_tokens=False)["input_ids"])
    )
    model.train()
    for step in resumable_steps(steps, state_dir, save_every, stop, model, opt, sched, rng, losses):
        rows = [
            (example(p, rng) if example is not None else None)
            or sft_example(p, tokenizer, rng, distractor, encode)
            for p in rng.sample(prompts, min(batch_size, len(prompts)))
        ]
        batches, agg = micro_batches(
            rows,
            tokenizer.pad_token_id,
            max_tokens=max_tokens_per_micro_batch,
            max_rows=len(rows),
            device=model_device(model),
        )
        params = list(model.parameters())
        step_out = optimizer_step(
            opt, sched, params, grad_clip, batches, lambda b, agg=agg: (nll(model, b, agg), {})
        )
        losses.append(step_out.loss)
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def save_model(model, tokenizer, out: Path, state_dir: Path | None = None) -> None:
    """Write the finished warm-up policy to ``out`` atomically and durably, then remove its
    resume state: a crash at any point leaves either the state to continue from or the
    whole model, never a half-written model the loader trips on."""
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    fsync_tree(tmp)
    tmp.rename(out)
    fsync_dir(out.parent)
    if state_dir is not None and state_dir.exists():
        shutil.rmtree(state_dir)  # our own resume state, superseded by the finished model


STATE_FILE = "state.pt"


def save_train_state(state_dir: Path, model, opt, sched, rng: random.Random, losses) -> None:
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "losses": losses,
    }
    save_state(state, tmp / STATE_FILE)
    old = state_dir.with_name(state_dir.name + ".old")
    if state_dir.exists():  # the previous state stays until the new one is in place
        if old.exists():
            shutil.rmtree(old)
        state_dir.rename(old)
    tmp.rename(state_dir)  # a half-written state is never taken for a complete one
    fsync_dir(state_dir.parent)
    if old.exists():
        shutil.rmtree(old)


def steps_done(state_dir: Path) -> int:
    """Steps a saved resume state holds (0: none saved)."""
    state = state_dir / STATE_FILE
    return len(load_state(state)["losses"]) if state.is_file() else 0


def recover_state_dir(state_dir: Path) -> None:
    """Put back the previous state when a save stopped between its two renames."""
    old = state_dir.with_name(state_dir.name + ".old")
    if not state_dir.exists() and old.is_dir():
        old.rename(state_dir)


def load_train_state(state_dir: Path, model, opt, sched, rng: random.Random) -> list[float]:
    state = load_state(state_dir / STATE_FILE)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"])
    return list(state["losses"])


def start_train_state(model, lr: float, warmup_steps: int, steps: int, seed: int, state_dir):
    """AdamW, its warm-up-then-cosine schedule, the sampling rng and the losses so far: fresh,
    or resumed from ``state_dir`` when it holds a state (the SFT, reward-model and DPO stages)."""
    rng = random.Random(seed)
    opt = SlicedAdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine(warmup_steps, steps))
    losses: list[float] = []
    if state_dir is not None:
        recover_state_dir(state_dir)
    if state_dir is not None and (state_dir / STATE_FILE).is_file():
        losses = load_train_state(state_dir, model, opt, sched, rng)
    return opt, sched, rng, losses


def warmup_then_cosine(warmup_steps: int, total: int):
    import math

    warm = warmup_lambda(warmup_steps)

    def fn(step: int) -> float:
        if step < warmup_steps:
            return warm(step)
        progress = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn
