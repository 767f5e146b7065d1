"""Supervised fine-tuning as an objective of the offline loop (:mod:`rlpost.train.offline`).

A row is a :class:`~rlpost.types.Completion` whose ``loss_mask`` marks the tokens to learn:
a task prompt's ``str(answer)`` plus EOS (the warm-up of ``rlpost train``), or a
conversation's assistant tokens (:mod:`rlpost.data.conversations`). The loss is the
token-mean negative log-likelihood of those tokens over the whole step: a step's rows are
cut by :func:`~rlpost.train.optim.budget_slices` (rows x widest row within the budget,
longest first) and every micro-batch divides by the step's token count, so the step's
loss and gradient do not depend on the cut.

No pretrained model can be downloaded, so the default job first teaches the tiny model
the task's format with a short warm-up on the *training* split. ``distractor`` replaces a
fraction of targets with a systematically wrong rendering of the right answer (its digits
reversed: 27 -> "72"): the warm-up policy can produce the right answer but does not
reliably choose to, and RL on the verifiable reward is what selects it. 0: plain SFT.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlpost.algos.aggregate import Aggregation
from rlpost.train.batch import TrainBatch, collate, eval_mode, model_device, response_logprobs
from rlpost.train.optim import budget_slices
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


@dataclass
class SFT:
    """The SFT objective on ``prompts``. ``example(prompt, rng)`` builds a row in place of
    :func:`sft_example` (a conversation, or a demonstration whose tool output is masked);
    None falls back to the plain target. ``max_tokens`` > 0 cuts a step's rows into
    micro-batches of at most that many padded tokens."""

    tokenizer: object
    prompts: list[Prompt]
    example: Callable[[Prompt, random.Random], Completion | None] | None = None
    distractor: float = 0.0
    max_tokens: int = 0
    device: object = None

    def __post_init__(self) -> None:
        # Every step draws from the same prompts: tokenising each text once is a fifth of
        # a tiny model's warm-up saved.
        tok = self.tokenizer
        self.encode = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tuple(tok(t, add_special_tokens=False)["input_ids"])
        )

    def draw(self, rng: random.Random, batch_size: int) -> list:
        rows = [
            (self.example(p, rng) if self.example is not None else None)
            or sft_example(p, self.tokenizer, rng, self.distractor, self.encode)
            for p in rng.sample(self.prompts, min(batch_size, len(self.prompts)))
        ]
        batches, agg = micro_batches(
            rows,
            self.tokenizer.pad_token_id,
            max_tokens=self.max_tokens,
            max_rows=len(rows),
            device=self.device,
        )
        return [(b, agg) for b in batches]

    def loss(self, model, micro) -> tuple[torch.Tensor, dict[str, float]]:
        return nll(model, *micro), {}


def micro_batches(
    rows: list[Completion], pad_id: int, *, max_tokens: int, max_rows: int, device=None
) -> tuple[list[TrainBatch], Aggregation]:
    """(micro-batches, the aggregation of the whole step) of ``rows``; ``max_tokens`` 0:
    micro-batches of ``max_rows`` rows."""
    ids = torch.arange(len(rows))
    p = torch.tensor([len(r.prompt_ids) for r in rows])
    t = torch.tensor([len(r.token_ids) for r in rows])
    slices = budget_slices(ids, p, t, max_rows, max_tokens)
    batches = [collate([rows[i] for i in s.tolist()], [0.0] * len(s), pad_id) for s in slices]
    if device is not None:
        batches = [b.to(device) for b in batches]
    mask = torch.cat([b.response_mask.flatten() for b in batches])
    return batches, Aggregation.for_minibatch(mask.unsqueeze(0))


def nll(model, batch: TrainBatch, agg: Aggregation) -> torch.Tensor:
    """The micro-batch's share of the step's token-mean negative log-likelihood."""
    logprobs, _ = response_logprobs(model, batch)
    return agg.reduce(-logprobs, batch.response_mask)


@torch.no_grad()
def mean_nll(model, rows: list[Completion], pad_id: int, *, max_tokens: int, max_rows: int):
    """Token-mean negative log-likelihood of ``rows``' assistant tokens (held-out loss)."""
    if not rows:
        return None
    batches, agg = micro_batches(
        rows, pad_id, max_tokens=max_tokens, max_rows=max_rows, device=model_device(model)
    )
    with eval_mode(model):
        return sum(float(nll(model, b, agg)) for b in batches)


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: list[str], *, max_new_tokens: int, batch: int = 32):
    """The greedy reply to each rendered prompt (up to EOS or ``max_new_tokens``)."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    out: list[str] = []
    try:
        with eval_mode(model):
            for lo in range(0, len(prompts), batch):
                enc = tokenizer(
                    prompts[lo : lo + batch],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                ).to(model_device(model))
                gen = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                new = gen[:, enc["input_ids"].shape[1] :]
                out += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return out
