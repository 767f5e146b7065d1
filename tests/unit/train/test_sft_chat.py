"""Conversation SFT steps: the token budget does not change the step, the held-out loss
is the token mean over assistant tokens (CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

from rlpost.config import OptimConfig
from rlpost.data.conversations import chat_arith, encode_conversations, ensure_chat_template
from rlpost.data.files import LoadReport
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.train.batch import collate, response_logprobs
from rlpost.train.offline import Schedule, train_offline
from rlpost.train.sft import SFT, mean_nll, micro_batches
from rlpost.types import Prompt


def _setup():
    tok = build_char_tokenizer()
    ensure_chat_template(tok)
    model = build_tiny_model(
        tok, seed=0, hidden_size=32, intermediate_size=64, max_position_embeddings=256
    )
    rows = encode_conversations(
        chat_arith(12),
        tok,
        last_turn_only=False,
        max_len=256,
        on_bad_row="error",
        report=LoadReport(),
    )
    return tok, model, rows


def _train(budget: int) -> tuple[list[float], torch.nn.Module]:
    tok, model, rows = _setup()
    prompts = [Prompt(text="", metadata={"example": r}) for r in rows]
    torch.manual_seed(0)
    sft = SFT(tok, prompts, example=lambda p, rng: p.metadata["example"], max_tokens=budget)
    losses = train_offline(model, sft, Schedule(steps=3, batch_size=8, optim=OptimConfig(lr=1e-3)))
    return losses, model


def test_a_token_budget_splits_the_step_without_changing_it():
    whole, a = _train(0)
    split, b = _train(300)  # rows of ~100-110 tokens: two or three a micro-batch
    assert split == pytest.approx(whole, rel=1e-4)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_micro_batches_keep_to_the_budget_and_cover_every_row():
    tok, _, rows = _setup()
    batches, agg = micro_batches(rows, tok.pad_token_id, max_tokens=300, max_rows=8)
    assert len(batches) > 1
    assert all(b.input_ids.numel() <= 300 for b in batches)
    assert sum(b.input_ids.shape[0] for b in batches) == len(rows)
    assert agg.num_tokens == sum(sum(r.loss_mask) for r in rows)


def test_held_out_loss_is_the_mean_over_assistant_tokens():
    tok, model, rows = _setup()
    got = mean_nll(model, rows, tok.pad_token_id, max_tokens=300, max_rows=4)
    with torch.no_grad():
        batch = collate(rows, [0.0] * len(rows), tok.pad_token_id)
        lp, _ = response_logprobs(model, batch)
        want = float(-(lp * batch.response_mask).sum() / batch.response_mask.sum())
    assert got == pytest.approx(want, rel=1e-4)
