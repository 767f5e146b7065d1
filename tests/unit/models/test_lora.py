"""LoRA: starts as the base, trains only adapters, reference = adapters off, merged weights
serve the same function, adapters round-trip (CPU; skipped without peft)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

from rlpost.models.lora import (
    LoRASettings,
    apply_lora,
    load_adapters,
    merged_weights,
    reference_mode,
    save_adapters,
)
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture
def base():
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=32, intermediate_size=64, seed=0), tok


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train_a_bit(model, ids, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_lora_trains_only_adapters_and_reference_is_the_base(base):
    model, tok = base
    ids = tok(["12+7=19", "3-1=2"], padding=True, return_tensors="pt")["input_ids"]
    before = _logits(model, ids)
    frozen = copy.deepcopy(model)
    lora = apply_lora(model, LoRASettings(rank=4, alpha=8))
    torch.testing.assert_close(_logits(lora, ids), before)  # B = 0: starts as the base
    trainable = sum(p.numel() for p in [p for p in lora.parameters() if p.requires_grad])
    total = sum(p.numel() for p in lora.parameters())
    assert 0 < trainable < 0.2 * total
    _train_a_bit(lora, ids)
    assert not torch.allclose(_logits(lora, ids), before)
    with reference_mode(lora):
        torch.testing.assert_close(_logits(lora, ids), before)  # no second copy needed
    original = dict(frozen.named_parameters())
    for name, p in lora.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, original[name.replace(".base_layer.", ".")]), name


def test_merged_weights_load_into_a_plain_model_and_match(base, tmp_path):
    model, tok = base
    plain = copy.deepcopy(model)
    ids = tok(["9+9=18"], return_tensors="pt")["input_ids"]
    lora = apply_lora(model, LoRASettings(rank=4, alpha=8))
    _train_a_bit(lora, ids)
    merged = merged_weights(lora)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain, ids), _logits(lora, ids), rtol=1e-4, atol=1e-5)
    out = save_adapters(lora, tmp_path / "adapters")
    assert (out / "adapter_config.json").is_file()
    fresh = apply_lora(
        build_tiny_model(tok, hidden_size=32, intermediate_size=64, seed=0),
        LoRASettings(rank=4, alpha=8),
    )
    load_adapters(fresh, out)
    torch.testing.assert_close(_logits(fresh, ids), _logits(lora, ids))


def test_targets_that_match_nothing_are_refused(base):
    with pytest.raises(ValueError, match="its linear layers are"):
        apply_lora(base[0], LoRASettings(target_modules=("c_attn",)))
