"""An interrupted warm-up continues exactly where it stopped (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.data import arith_splits
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.train.sft import WarmupInterrupted, sft_train


def _run(state_dir=None, stop=None, steps=6):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0, hidden_size=32, intermediate_size=64)
    train, _ = arith_splits(9, ["+"], 60, 10)
    kw = dict(steps=steps, lr=1e-3, batch_size=8, warmup_steps=2, seed=0)
    torch.manual_seed(0)
    return model, tok, train, kw, sft_train(model, tok, train, **kw, state_dir=state_dir, stop=stop)


def test_stop_saves_state_and_resume_matches_an_uninterrupted_warm_up(tmp_path):
    full_model, *_, full = _run()
    state = tmp_path / "sft_state"
    calls = []
    with pytest.raises(WarmupInterrupted) as err:
        _run(state, stop=lambda: calls.append(1) or len(calls) > 3)
    assert err.value.step == 3 and (state / "state.pt").is_file()
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=1, hidden_size=32, intermediate_size=64)  # other init
    train, _ = arith_splits(9, ["+"], 60, 10)
    losses = sft_train(
        model, tok, train, steps=6, lr=1e-3, batch_size=8, warmup_steps=2, seed=0, state_dir=state
    )
    assert losses == pytest.approx(full, rel=1e-6)
    for a, b in zip(model.parameters(), full_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not state.exists()  # the finished warm-up leaves no stale state behind
