"""The memory preflight: its terms follow the configured step, and a step that cannot fit
is refused in one line that names the key to change."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from rlpost.config import ConfigError, load_config
from rlpost.pipeline.memory import check_memory, estimate, model_shape, summary_fields


def _real_shape_dir(tmp_path):
    """A config.json of a 151,936-token Llama (no weights: the estimate reads none)."""
    cfg = LlamaConfig(
        vocab_size=151_936,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    cfg.save_pretrained(tmp_path)
    return str(tmp_path)


def test_terms_follow_the_config(tmp_path):
    path = _real_shape_dir(tmp_path)
    base = ["rollout.max_tokens=256", "train.micro_batch_size=8", "algo.kl.beta=0"]
    cfg = load_config(None, [f"model.path={path}", *base])
    shape = model_shape(cfg)
    assert shape["vocab"] == 151_936 and 38e6 < shape["params"] < 45e6
    chunked = estimate(cfg, shape)
    full = estimate(
        load_config(None, [f"model.path={path}", *base, "train.logits_chunk_tokens=-1"]), shape
    )
    assert full.logits > 10 * chunked.logits  # [8, 256, V] x3 against one 64 MiB chunk x4
    assert chunked.reference == 0
    with_ref = estimate(load_config(None, [f"model.path={path}", "algo.kl.beta=0.1"]), shape)
    assert with_ref.reference == pytest.approx(chunked.weights)
    assert chunked.optimizer == pytest.approx(2 * chunked.gradients)
    default = check_memory(load_config(None, []))
    assert default is not None and default.total < chunked.total


def test_a_step_that_cannot_fit_is_refused_naming_the_key(tmp_path):
    path = _real_shape_dir(tmp_path)
    full = ["train.logits_chunk_tokens=-1", "rollout.max_tokens=1024", "train.micro_batch_size=8"]
    cfg = load_config(None, [f"model.path={path}", *full])
    est = estimate(cfg, model_shape(cfg))
    with pytest.raises(ConfigError, match=r"largest: logits .*train.logits_chunk_tokens=0") as e:
        check_memory(cfg, total_mib=est.total - 1)
    assert "\n" not in str(e.value)
    assert check_memory(cfg, total_mib=est.total + 1).total == pytest.approx(est.total)


def test_summary_fields_hold_the_measured_peak_and_the_estimate():
    est = check_memory(load_config(None, []))
    out = json.loads(json.dumps(summary_fields(est)))
    assert out["peak_rss_mib"] > 50
    assert out["memory_estimate_mib"]["total"] == round(est.total)
