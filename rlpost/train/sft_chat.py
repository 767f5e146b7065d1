"""The pieces of SFT on conversations that touch the model: token-budget micro-batches of
masked examples, the held-out loss, and greedy answers for the held-out accuracy.

An example is a :class:`~rlpost.types.Completion` whose ``loss_mask`` is 1 on assistant
tokens (:mod:`rlpost.data.conversations`). A step's rows are cut by
:func:`~rlpost.train.optim.budget_slices` (rows x widest row within the budget, longest
first), and every micro-batch's loss divides by the token count of the whole step, so the
step's loss and gradient do not depend on the split.
"""

from __future__ import annotations

import torch

from rlpost.algos.aggregate import Aggregation
from rlpost.train.batch import TrainBatch, collate, model_device, response_logprobs
from rlpost.train.optim import budget_slices
from rlpost.types import Completion


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
    was_training = model.training
    model.eval()
    batches, agg = micro_batches(
        rows, pad_id, max_tokens=max_tokens, max_rows=max_rows, device=model_device(model)
    )
    total = sum(float(nll(model, b, agg)) for b in batches)
    model.train(was_training)
    return total


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: list[str], *, max_new_tokens: int, batch: int = 32):
    """The greedy reply to each rendered prompt (up to EOS or ``max_new_tokens``)."""
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    out: list[str] = []
    try:
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
        model.train(was_training)
    return out
