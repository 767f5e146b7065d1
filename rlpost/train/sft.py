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

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from rlpost.algos.aggregate import Aggregation
from rlpost.train.actor import warmup_lambda
from rlpost.train.batch import collate, model_device, response_logprobs
from rlpost.types import Completion, Prompt


def reverse_digits(answer: object) -> str:
    """``27 -> "72"``, ``-31 -> "-13"``: the distractor rendering of an integer answer."""
    text = str(answer)
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    return sign + digits[::-1]


def sft_example(prompt: Prompt, tokenizer, rng: random.Random, distractor: float) -> Completion:
    text = str(prompt.answer)
    if distractor > 0 and isinstance(prompt.answer, int) and rng.random() < distractor:
        text = reverse_digits(prompt.answer)
    target = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    return Completion(ids, target, [0.0] * len(target), "stop", 0, 0)


class WarmupInterrupted(KeyboardInterrupt):
    """The warm-up stopped on request after ``step`` steps; its state is saved for a resume."""

    def __init__(self, step: int, state_dir: Path | None) -> None:
        super().__init__(f"warm-up stopped after step {step}")
        self.step, self.state_dir = step, state_dir


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
) -> list[float]:
    """Train ``model`` in place for ``steps`` steps; returns the loss of each step.

    When ``stop()`` turns true the current step finishes, the warm-up state (weights,
    optimizer, scheduler, data RNG, losses) is saved to ``state_dir`` and
    :class:`WarmupInterrupted` is raised; a later call with the same ``state_dir``
    continues from there exactly, and removes the state once the warm-up is done.
    ``example(prompt, rng)`` builds a target in place of :func:`sft_example` (a multi-turn
    demonstration whose tool output is masked); None falls back to the plain target.
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine(warmup_steps, steps))
    losses: list[float] = []
    if state_dir is not None and (state_dir / STATE_FILE).is_file():
        losses = _load_state(state_dir, model, opt, sched, rng)
    model.train()
    for step in range(len(losses), steps):
        if stop is not None and stop():
            if state_dir is not None:
                _save_state(state_dir, model, opt, sched, rng, losses)
            raise WarmupInterrupted(step, state_dir)
        rows = [
            (example(p, rng) if example is not None else None)
            or sft_example(p, tokenizer, rng, distractor)
            for p in rng.sample(prompts, min(batch_size, len(prompts)))
        ]
        batch = collate(rows, [0.0] * len(rows), tokenizer.pad_token_id).to(model_device(model))
        logprobs, _ = response_logprobs(model, batch)
        loss = Aggregation("token-mean").reduce(-logprobs, batch.response_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    if state_dir is not None and state_dir.exists():
        shutil.rmtree(state_dir)  # our own resume state, superseded by the finished model
    return losses


STATE_FILE = "state.pt"


def _save_state(state_dir: Path, model, opt, sched, rng: random.Random, losses) -> None:
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
    torch.save(state, tmp / STATE_FILE)
    if state_dir.exists():
        shutil.rmtree(state_dir)
    tmp.rename(state_dir)  # a half-written state is never taken for a complete one


def _load_state(state_dir: Path, model, opt, sched, rng: random.Random) -> list[float]:
    # weights_only=False: the state holds the RNG tuple we wrote ourselves.
    state = torch.load(state_dir / STATE_FILE, weights_only=False, map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"])
    return list(state["losses"])


def warmup_then_cosine(warmup_steps: int, total: int):
    import math

    warm = warmup_lambda(warmup_steps)

    def fn(step: int) -> float:
        if step < warmup_steps:
            return warm(step)
        progress = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn
