"""A stopped or killed offline run resumes to the weights of one that never stopped, for
the SFT and the DPO objective alike (CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

from rlpost.config import OptimConfig
from rlpost.data import arith_splits
from rlpost.data.preferences import preference_splits
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.train.checkpoint import latest_step, usable_checkpoint
from rlpost.train.dpo import DPO, attach_reference, encode_pairs
from rlpost.train.offline import (
    Schedule,
    TrainingStopped,
    save_model,
    saved_state,
    train_offline,
)
from rlpost.train.sft import SFT

SCHEDULE = Schedule(steps=6, batch_size=8, optim=OptimConfig(lr=1e-3, warmup_steps=2), seed=0)


def _model(seed: int):
    tok = build_char_tokenizer()
    return build_tiny_model(tok, seed=seed, hidden_size=32, intermediate_size=64), tok


def _sft(tok):
    train, _ = arith_splits(9, ["+"], 60, 10)
    return SFT(tok, train, distractor=0.3)


def _dpo(model, tok):
    train, _ = preference_splits(9, ["+"], train_size=20, eval_size=4)
    pairs = encode_pairs(train, tok)
    attach_reference(model, pairs, tok.pad_token_id, chunk=64)
    pairs.ref_chosen = pairs.ref_chosen + 0.5  # a reference apart from the policy
    return DPO(pairs, tok.pad_token_id, 3, {"beta": 0.1, "loss_type": "sigmoid"})


def _stop_after(n: int):
    calls = []
    return lambda: calls.append(1) or len(calls) > n


def _killed_after(n: int):
    calls = []

    def stop():  # the process dies before step n + 1, without a save of its own
        calls.append(1)
        if len(calls) > n:
            raise SystemExit("killed")
        return False

    return stop


def _assert_same(a, b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, objective, how):
    build = _sft if objective == "sft" else None
    full, tok = _model(0)
    make = (lambda m, t: build(t)) if build else _dpo
    torch.manual_seed(0)
    want = train_offline(full, make(full, tok), SCHEDULE)

    state = tmp_path / "state"
    cut, tok = _model(0)
    torch.manual_seed(0)
    save_every = 2 if how == "killed" else 0
    stop = _stop_after(3) if how == "stopped" else _killed_after(5)
    s = Schedule(**{**SCHEDULE.__dict__, "save_every": save_every})
    with pytest.raises(TrainingStopped if how == "stopped" else SystemExit):
        train_offline(cut, make(cut, tok), s, state_dir=state, tokenizer=tok, stop=stop)
    ckpt = usable_checkpoint(state)
    assert latest_step(ckpt) == (3 if how == "stopped" else 4)
    assert (ckpt / "model" / "config.json").is_file() and (ckpt / "trainer_state.pt").is_file()

    resumed, tok = _model(1)  # another init: the checkpoint supplies every weight
    objective_again = make(_model(0)[0], tok)  # the reference: the run's starting policy
    torch.manual_seed(123)  # the checkpoint supplies the RNG states too
    got = train_offline(resumed, objective_again, s, state_dir=state, tokenizer=tok)
    assert got == want  # the same loss at every step, the saved ones included
    _assert_same(resumed, full)
    save_model(resumed, tok, tmp_path / "out", state_dir=state)
    assert (tmp_path / "out" / "config.json").is_file() and not state.exists()


def test_what_the_caller_keeps_comes_back_from_the_checkpoint(tmp_path):
    model, tok = _model(0)
    ref = torch.arange(4, dtype=torch.float32)
    with pytest.raises(TrainingStopped):
        train_offline(
            model, _sft(tok), SCHEDULE, state_dir=tmp_path, stop=_stop_after(1), keep={"ref": ref}
        )
    assert torch.equal(saved_state(tmp_path)["ref"], ref)
    assert saved_state(tmp_path / "none") is None
