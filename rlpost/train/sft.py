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
from collections.abc import Callable

import torch

from rlpost.algos.aggregate import Aggregation
from rlpost.train.actor import warmup_lambda
from rlpost.train.batch import collate, response_logits, token_logprobs
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
) -> list[float]:
    """Train ``model`` in place for ``steps`` steps; returns the loss of each step."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine(warmup_steps, steps))
    model.train()
    losses = []
    for step in range(steps):
        rows = [
            sft_example(p, tokenizer, rng, distractor)
            for p in rng.sample(prompts, min(batch_size, len(prompts)))
        ]
        batch = collate(rows, [0.0] * len(rows), tokenizer.pad_token_id)
        logprobs = token_logprobs(response_logits(model, batch), batch.responses)
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
    return losses


def warmup_then_cosine(warmup_steps: int, total: int):
    import math

    warm = warmup_lambda(warmup_steps)

    def fn(step: int) -> float:
        if step < warmup_steps:
            return warm(step)
        progress = (step - warmup_steps) / max(1, total - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn
