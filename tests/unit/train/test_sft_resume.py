"""An interrupted warm-up continues exactly where it stopped (CPU)."""

from __future__ import annotations

import pytest
import torch

from rlpost.data import arith_splits
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.statefile import load_state
from rlpost.train.sft import WarmupInterrupted, save_model, sft_train


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
    assert (state / "state.pt").is_file()  # kept until the finished model is written
    save_model(model, tok, tmp_path / "sft_model", state_dir=state)
    assert (tmp_path / "sft_model" / "config.json").is_file()
    assert not state.exists()  # the finished warm-up leaves no stale state behind
    assert not (tmp_path / ".sft_model.tmp").exists()


def test_a_killed_warm_up_continues_from_its_last_periodic_save(tmp_path):
    """``save_every``: the state is on disk without any stop request, so SIGKILL (here: the
    process simply not finishing) loses at most ``save_every`` steps."""
    *_, full = _run()
    state = tmp_path / "sft_state"
    calls = []

    def killed():  # the step counter passes 5 and the process dies without saving
        calls.append(1)
        if len(calls) > 5:
            raise SystemExit("killed")
        return False

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0, hidden_size=32, intermediate_size=64)
    train, _ = arith_splits(9, ["+"], 60, 10)
    kw = dict(steps=6, lr=1e-3, batch_size=8, warmup_steps=2, seed=0, state_dir=state)
    torch.manual_seed(0)
    with pytest.raises(SystemExit):
        sft_train(model, tok, train, **kw, stop=killed, save_every=2)
    assert len(load_state(state / "state.pt")["losses"]) == 4  # the save at step 4
    model = build_tiny_model(tok, seed=1, hidden_size=32, intermediate_size=64)
    assert sft_train(model, tok, train, **kw, save_every=2) == pytest.approx(full, rel=1e-6)
