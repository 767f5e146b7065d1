"""Reward-model training: a one-output sequence classifier, its pair tensors and its steps.

    causal-LM checkpoint --backbone--> sequence classifier (num_labels=1, new score head)
    pairs --reward_input_ids--> chosen / rejected token ids --BT steps--> reward model

The model is ``AutoModelForSequenceClassification`` built from the causal LM's own
config with ``num_labels=1``; the LM's backbone weights are copied in, the score head is
new (seeded). Its inputs are :func:`rlpost.rewards.model.reward_input_ids`'s, the same
function the ``reward_model`` reward scores with, so the saved model reads at scoring
time exactly what it was trained on. A micro-batch's chosen and rejected responses go
through the model in one forward pass, right-padded; the classifier reads the logit at
the last non-pad token (``config.pad_token_id``). The loss is
:func:`rlpost.algos.reward_model.bradley_terry_loss`; the steps are the offline loop's
(:mod:`rlpost.train.offline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForSequenceClassification

from rlpost.algos.reward_model import bradley_terry_loss
from rlpost.data.files import LoadReport, refuse_or_skip
from rlpost.data.preferences import PreferencePair
from rlpost.rewards.model import reward_input_ids
from rlpost.train.batch import eval_mode, model_device
from rlpost.train.offline import pair_parts


@dataclass(frozen=True)
class EncodedPairs:
    """Token ids of each pair's (prompt + chosen) and (prompt + rejected); ``margin``
    ``[N]`` float32 or None (no pair has one)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: torch.Tensor | None

    def __len__(self) -> int:
        return len(self.chosen)


def reward_model_from(lm: torch.nn.Module, pad_token_id: int, seed: int) -> torch.nn.Module:
    """A ``num_labels=1`` sequence classifier with ``lm``'s backbone weights and a new score
    head (initialised under ``seed``)."""
    config = lm.config.__class__.from_dict(lm.config.to_dict())
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    backbone = getattr(model, model.base_model_prefix)
    backbone.load_state_dict(getattr(lm, lm.base_model_prefix).state_dict())
    return model.to(next(lm.parameters()).dtype)


def encode_pairs(
    pairs: list[PreferencePair], tokenizer, *, max_len: int, on_bad_row: str, report: LoadReport
) -> EncodedPairs:
    """Tokenise every pair as the reward model will be scored; a pair longer than
    ``max_len`` tokens is a bad row (``pair_too_long``), refused or skipped and counted in
    ``report`` under its ``uid`` (``file:line`` for a file), never truncated."""
    chosen_ids = reward_input_ids(tokenizer, [(p.prompt, p.chosen) for p in pairs])
    rejected_ids = reward_input_ids(tokenizer, [(p.prompt, p.rejected) for p in pairs])
    kept: list[int] = []
    for i, p in enumerate(pairs):
        longest = max(len(chosen_ids[i]), len(rejected_ids[i]))
        if longest > max_len:
            problem = ("pair_too_long", f"pair is {longest} tokens; the model holds {max_len}")
            refuse_or_skip(p.uid or "pair", problem, on_bad_row, report)
            report.rows -= 1
            continue
        kept.append(i)
    margins = [pairs[i].margin for i in kept]
    margin = None
    if any(m is not None for m in margins):
        margin = torch.tensor([m or 0.0 for m in margins], dtype=torch.float32)
    return EncodedPairs([chosen_ids[i] for i in kept], [rejected_ids[i] for i in kept], margin)


def pair_rewards(model, pairs: EncodedPairs, idx: list[int], pad_id: int):
    """(chosen ``[n]``, rejected ``[n]``) rewards of pairs ``idx``, one forward pass of
    ``2n`` right-padded rows, with gradient when the caller allows it."""
    rows = [
        torch.tensor(r, dtype=torch.long)
        for r in [pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx]
    ]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    device = model_device(model)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0]
    logits = logits.float()
    return logits[: len(idx)], logits[len(idx) :]


@torch.no_grad()
def evaluate_rm(model, pairs: EncodedPairs, pad_id: int, chunk: int = 128) -> dict[str, float]:
    """Held-out ``eval_accuracy`` (pairs ranked right, ties half), ``eval_loss`` (the mean
    Bradley-Terry loss, margins included) and reward means of ``model`` on ``pairs``."""
    with eval_mode(model):
        parts = [
            pair_rewards(model, pairs, list(range(lo, min(lo + chunk, len(pairs)))), pad_id)
            for lo in range(0, len(pairs), chunk)
        ]
    rc, rr = (torch.cat(side) for side in zip(*parts, strict=True))
    out = bradley_terry_loss(rc, rr, margin=pairs.margin)
    return {
        "eval_accuracy": float(out.stats["accuracy"]),
        "eval_loss": float(out.loss),
        "eval_reward_margin": float(out.stats["reward_margin"]),
        "eval_chosen_reward": float(out.stats["chosen_reward"]),
        "eval_rejected_reward": float(out.stats["rejected_reward"]),
    }


@dataclass
class BradleyTerry:
    """The reward model's objective on ``pairs``: a micro-batch's loss divides by the step's
    pair count, so the step does not depend on the cut."""

    pairs: EncodedPairs
    pad_id: int
    micro_batch_size: int

    def draw(self, rng, batch_size: int) -> list:
        return pair_parts(rng, len(self.pairs), batch_size, self.micro_batch_size)

    def loss(self, model, micro) -> tuple[torch.Tensor, dict[str, float]]:
        part, total = micro
        rc, rr = pair_rewards(model, self.pairs, part, self.pad_id)
        margin = None if self.pairs.margin is None else self.pairs.margin[torch.tensor(part)]
        out = bradley_terry_loss(rc, rr, margin=margin, num_pairs=total)
        return out.loss, {k: float(v) * len(part) / total for k, v in out.stats.items()}
