"""Offline preference optimisation (DPO / IPO): the pair tensors, the reference, the objective.

    pairs --sft on chosen--> starting policy --frozen copy--> reference log-probs (once)
          --dpo steps--> policy --held-out pairs--> preference accuracy before / after

The reference is never kept: its log-probs are computed once with the starting policy. The
loss is :func:`rlpost.algos.dpo.dpo_loss`. Held-out accuracy counts a tie (every pair before
training) as one half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.aggregate import masked_sum
from rlpost.algos.dpo import dpo_loss
from rlpost.data.preferences import PreferencePair
from rlpost.train.batch import (
    TrainBatch,
    collate,
    compute_logprobs,
    response_logprobs,
)
from rlpost.train.offline import pair_parts
from rlpost.types import Completion


@dataclass
class PairSet:
    """Tokenised pairs; ``ref_chosen`` / ``ref_rejected``: ``[N]`` summed log-probs of the
    starting policy, from :func:`attach_reference`."""

    chosen: list[Completion]
    rejected: list[Completion]
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.chosen)


def encode_pairs(pairs: list[PreferencePair], tokenizer) -> PairSet:
    """Tokenise prompts and responses; each response ends with EOS, as the policy would stop."""

    def completion(prompt_ids: list[int], text: str, i: int) -> Completion:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return Completion(prompt_ids, ids, [0.0] * len(ids), "stop", 0, i)

    chosen, rejected = [], []
    for i, pair in enumerate(pairs):
        prompt_ids = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]
        chosen.append(completion(prompt_ids, pair.chosen, i))
        rejected.append(completion(prompt_ids, pair.rejected, i))
    return PairSet(chosen, rejected)


def pair_batch(pairs: PairSet, idx: list[int], pad_id: int) -> TrainBatch:
    """Rows ``0..n-1`` are the chosen responses of pairs ``idx``, rows ``n..2n-1`` the rejected."""
    rows = [pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx]
    return collate(rows, [0.0] * len(rows), pad_id)


def sequence_logprobs(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Summed response log-probs ``[B]`` (with gradient): sum_t log pi(y_t | x, y_<t)."""
    logprobs, _ = response_logprobs(model, batch)
    return masked_sum(logprobs, batch.response_mask, dim=-1)


@torch.no_grad()
def pair_logprobs(
    model: torch.nn.Module, pairs: PairSet, pad_id: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen ``[N]``, rejected ``[N]``) summed log-probs, bit-identical per ``chunk``."""
    chosen, rejected = [], []
    for lo in range(0, len(pairs), chunk):
        idx = list(range(lo, min(lo + chunk, len(pairs))))
        batch = pair_batch(pairs, idx, pad_id)
        lp = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=2 * len(idx))
        seq = masked_sum(lp, batch.response_mask, dim=-1)
        chosen.append(seq[: len(idx)])
        rejected.append(seq[len(idx) :])
    return torch.cat(chosen), torch.cat(rejected)


def attach_reference(model: torch.nn.Module, pairs: PairSet, pad_id: int, chunk: int) -> None:
    """Fill ``pairs.ref_chosen`` / ``ref_rejected`` from the (frozen, starting) ``model``."""
    pairs.ref_chosen, pairs.ref_rejected = pair_logprobs(model, pairs, pad_id, chunk)


def _tie_half(x: torch.Tensor) -> float:
    """Mean of ``1[x > 0] + 0.5 * 1[x == 0]`` over ``x [N]``."""
    return float(((x > 0).float() + 0.5 * (x == 0).float()).mean())


def evaluate_pairs(
    model: torch.nn.Module, pairs: PairSet, pad_id: int, loss_kwargs: dict, chunk: int = 256
) -> dict[str, float]:
    """Held-out preference metrics of ``model`` against the stored reference log-probs.

    ``eval_pref_accuracy`` (implicit reward) and ``eval_logp_accuracy`` (log-prob) count
    ties half; ``eval_margin``: mean ``beta h``."""
    pc, pr = pair_logprobs(model, pairs, pad_id, chunk)
    out = dpo_loss(pc, pr, pairs.ref_chosen, pairs.ref_rejected, **loss_kwargs)
    h = (pc - pairs.ref_chosen) - (pr - pairs.ref_rejected)
    return {
        "eval_pref_accuracy": _tie_half(h),
        "eval_margin": float(out.stats["reward_margin"]),
        "eval_loss": float(out.loss),
        "eval_logp_accuracy": _tie_half(pc - pr),
        "eval_chosen_logp": float(pc.mean()),
        "eval_rejected_logp": float(pr.mean()),
    }


@dataclass
class DPO:
    """The DPO / IPO objective on ``pairs`` (reference attached). A micro-batch's loss divides
    by the step's pair count, so the summed gradient is the step's whatever the cut."""

    pairs: PairSet
    pad_id: int
    micro_batch_size: int
    loss_kwargs: dict

    def draw(self, rng, batch_size: int) -> list:
        return pair_parts(rng, len(self.pairs), batch_size, self.micro_batch_size)

    def loss(self, model, micro) -> tuple[torch.Tensor, dict[str, float]]:
        part, total = micro
        seq = sequence_logprobs(model, pair_batch(self.pairs, part, self.pad_id))
        rows = torch.tensor(part)
        chosen, rejected = seq[: len(part)], seq[len(part) :]
        ref_c, ref_r = self.pairs.ref_chosen[rows], self.pairs.ref_rejected[rows]
        out = dpo_loss(chosen, rejected, ref_c, ref_r, **self.loss_kwargs, num_pairs=total)
        return out.loss, {k: float(v) * len(part) / total for k, v in out.stats.items()}
