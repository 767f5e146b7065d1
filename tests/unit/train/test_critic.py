"""The PPO critic on CPU: value alignment, fitting, clipping, micro-batch invariance, state."""

from __future__ import annotations

import pytest
import torch

from rlpost.config import OptimConfig
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.train.batch import collate
from rlpost.train.critic import CriticTrainer, ValueModel, response_values
from rlpost.types import Completion


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors gain nothing from more threads, and a busy shared CPU stalls them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, intermediate_size=64, seed=3)
    return model, tokenizer


def _batch(tokenizer, rows=(("12+7=", "19"), ("3-5=", "-2"), ("40+40=", "80"), ("1+1=", "2"))):
    """A right-padded batch with prompts and responses of different lengths."""
    completions = []
    for i, (prompt, response) in enumerate(rows):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        completions.append(Completion(p, r, [0.0] * len(r), "stop", 0, i))
    return collate(completions, [0.0] * len(completions), tokenizer.pad_token_id)


def _trainer(model, **kw) -> CriticTrainer:
    args = dict(
        optim=OptimConfig(lr=1e-2), mini_batch_size=4, micro_batch_size=4, clip_range=None, seed=0
    )
    args.update(kw)
    return CriticTrainer(model, **args)


def test_values_are_the_states_before_each_response_token(policy):
    model, tokenizer = policy
    vm = ValueModel.from_policy(model).eval()
    batch = _batch(tokenizer)
    P, T = batch.prompt_width, batch.responses.shape[1]
    with torch.no_grad():
        values = response_values(vm, batch)
        full = vm(batch.input_ids, batch.attention_mask, batch.position_ids)
    assert values.shape == (len(batch), T) and values.dtype == torch.float32
    assert torch.equal(values, full[:, P - 1 : P + T - 1])
    # Changing response token 1 leaves the values of states 0 and 1 (which precede it) alone
    # and changes the value of state 2 (which has seen it).
    edited = _batch(tokenizer)
    edited.input_ids[0, P + 1] = tokenizer.convert_tokens_to_ids("5")
    with torch.no_grad():
        after = response_values(vm, edited)
    assert torch.allclose(after[0, :2], values[0, :2], atol=1e-6)
    assert not torch.allclose(after[0, 2], values[0, 2], atol=1e-6)


def test_from_policy_copies_the_weights_and_drops_the_lm_head(policy):
    model, _ = policy
    vm = ValueModel.from_policy(model)
    embed = vm.backbone.get_input_embeddings().weight
    assert torch.equal(embed, model.get_input_embeddings().weight)
    with torch.no_grad():
        embed.add_(1.0)
    assert not torch.equal(embed, model.get_input_embeddings().weight)  # a copy, not a view
    assert not any("lm_head" in name for name, _ in vm.named_parameters())


def test_trainer_values_are_zero_on_padding(policy):
    model, tokenizer = policy
    batch = _batch(tokenizer)
    values = _trainer(ValueModel.from_policy(model), micro_batch_size=3).values(batch)
    assert values.shape == batch.response_mask.shape
    assert torch.all(values[batch.response_mask == 0] == 0)
    assert torch.any(values[batch.response_mask > 0] != 0)


def test_update_fits_fixed_returns(policy):
    model, tokenizer = policy
    batch = _batch(tokenizer)
    torch.manual_seed(0)
    batch.returns = torch.randn(batch.response_mask.shape) * batch.response_mask
    trainer = _trainer(ValueModel.from_policy(model), optim=OptimConfig(lr=3e-3))
    batch.values = trainer.values(batch)
    first = trainer.update(batch)
    for _ in range(60):
        last = trainer.update(batch)
    assert last["vf_loss"] < 0.1 * first["vf_loss"]
    assert last["vf_explained_var"] > 0.8 > first["vf_explained_var"]
    for key in ("vf_clip_frac", "critic_grad_norm", "critic_lr", "critic_updates", "vpred_mean"):
        assert key in last


def test_clipping_stops_values_beyond_the_clip_range(policy):
    model, tokenizer = policy
    batch = _batch(tokenizer)
    vm = ValueModel.from_policy(model)
    now = _trainer(vm).values(batch)
    mask = batch.response_mask
    # Old values 5 below the current ones and returns 5 above: moving towards the returns
    # takes the prediction outside old +- clip_range, so the clipped branch is the larger
    # error and it is flat in the prediction.
    batch.values, batch.returns = (now - 5.0) * mask, (now + 5.0) * mask
    clipped = _trainer(vm, clip_range=0.2)
    before = [p.detach().clone() for p in vm.parameters()]
    stats = clipped.update(batch)
    assert stats["vf_clip_frac"] == pytest.approx(1.0)
    assert stats["critic_grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, vm.parameters(), strict=True))
    unclipped = _trainer(vm, clip_range=None).update(batch)
    assert unclipped["vf_clip_frac"] == 0.0 and unclipped["critic_grad_norm"] > 0.0


def test_update_does_not_depend_on_the_micro_batch_size(policy):
    model, tokenizer = policy
    batch = _batch(tokenizer)
    torch.manual_seed(1)
    batch.returns = torch.randn(batch.response_mask.shape) * batch.response_mask
    results = []
    for micro in (4, 1):
        torch.manual_seed(2)  # the same value-head initialisation for both
        vm = ValueModel.from_policy(model)
        trainer = _trainer(vm, micro_batch_size=micro, clip_range=0.2)
        batch.values = trainer.values(batch)
        stats = trainer.update(batch)
        results.append((stats, [p.detach().clone() for p in vm.parameters()]))
    (s4, w4), (s1, w1) = results
    assert s1["vf_loss"] == pytest.approx(s4["vf_loss"], rel=1e-5)
    assert s1["critic_grad_norm"] == pytest.approx(s4["critic_grad_norm"], rel=1e-4)
    for a, b in zip(w4, w1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_state_round_trip_gives_the_same_next_update(policy, tmp_path):
    model, tokenizer = policy
    batch = _batch(tokenizer)
    batch.returns = torch.linspace(-1, 1, batch.response_mask.numel()).view_as(batch.response_mask)
    a = _trainer(ValueModel.from_policy(model), mini_batch_size=2, micro_batch_size=1)
    batch.values = a.values(batch)
    a.update(batch)
    torch.save(a.state_dict(), tmp_path / "state.pt")  # as a checkpoint stores it
    a.model.save_pretrained(tmp_path / "critic")
    b = _trainer(ValueModel.load(tmp_path / "critic"), mini_batch_size=2, micro_batch_size=1)
    torch.testing.assert_close(b.values(batch), a.values(batch))
    b.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    next_a, next_b = a.update(batch), b.update(batch)
    assert next_b["vf_loss"] == pytest.approx(next_a["vf_loss"], rel=1e-6)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)


def test_update_needs_returns_and_old_values(policy):
    model, tokenizer = policy
    with pytest.raises(ValueError, match=r"needs batch\.returns and batch\.values"):
        _trainer(ValueModel.from_policy(model)).update(_batch(tokenizer))


def test_the_value_head_computes_in_float32_under_bf16_autocast():
    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
    from rlpost.train.critic import ValueModel

    model = ValueModel.from_policy(build_tiny_model(build_char_tokenizer()))
    ids = torch.arange(3, 11).reshape(1, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=None)
    assert values.dtype == torch.float32
