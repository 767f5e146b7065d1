"""Prompt + max_tokens is checked against every model's positions before any work (CPU)."""

from __future__ import annotations

import json

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.models.loading import ModelLoadError, context_length
from rlpost.pipeline import build
from tests.conftest import small_overrides


def test_context_length_read_from_config_json(tiny_dir, tmp_path):
    assert context_length(tiny_dir) == 128
    nested = tmp_path / "m"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"n_positions": 64}}))
    assert context_length(nested) == 64
    (nested / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        context_length(nested)


def test_max_tokens_beyond_the_model_is_refused_with_numbers(tiny_dir, tmp_path):
    over = small_overrides(tmp_path, **{"model.path": tiny_dir, "rollout.max_tokens": 100000})
    with pytest.raises(ConfigError) as err:
        build.build_data(load_config(None, over))
    text = str(err.value)
    assert "rollout.max_tokens=100000" in text and "128 positions" in text
    assert "lower rollout.max_tokens" in text


def test_prompts_that_do_not_fit_are_filtered(tiny_dir, tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "9" * 130, "answer": 1}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    held = tmp_path / "held.jsonl"  # its own held-out file: every row of d.jsonl trains
    held.write_text(json.dumps(rows[0]) + "\n")
    extra = {"model.path": tiny_dir, "data.task": "file", "data.task.train_path": f,
             "data.task.eval_path": held}  # fmt: skip
    cfg = load_config(None, small_overrides(tmp_path, **extra, **{"data.on_bad_row": "skip"}))
    train, _, counts = build.build_data(cfg)
    assert len(train) == 1 and counts["train_skipped_prompt_too_long"] == 1
    cfg = load_config(None, small_overrides(tmp_path, **extra))
    with pytest.raises(
        ValueError, match=r"d.jsonl:2: prompt is 130 tokens; with rollout.max_tokens=4"
    ):
        build.build_data(cfg)
