"""The real loop on a tiny model: artifacts, resume exactness, guards on bad input."""

import json
import math

import pytest

from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_run_writes_everything_a_user_reads(tmp_path):
    cfg = load_config(None, small_overrides(tmp_path, **{"observe.plot": True}))
    result = train(cfg)
    run = result.run_dir
    summary = json.loads((run / "summary.json").read_text())
    for key in ("eval_accuracy_start", "eval_accuracy_end", "steps", "wall_seconds"):
        assert summary[key] is not None
    assert summary["steps"] == 3
    assert (run / "config.yaml").is_file() and (run / "curves.png").stat().st_size > 1000
    assert (run / "sft_model" / "config.json").is_file()
    rows = _losses(run)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        for key in (
            "truncated_frac",
            "zero_spread_frac",
            "logprob_gap",
            "reward_mean",
            "kl",
            "clip_frac",
        ):
            assert math.isfinite(r[key]), key
        assert r["logprob_gap"] < 1e-3  # engine and trainer agree on the same weights
        assert r["policy_version"] == r["step"] - 1  # the batch was sampled by the previous weights


def test_resume_computes_the_same_next_step_loss(tmp_path):
    full = train(load_config(None, small_overrides(tmp_path / "a", **{"train.steps": 4})))
    part = small_overrides(tmp_path / "b", **{"train.steps": 2})
    train(load_config(None, part))
    resumed = train(
        load_config(None, small_overrides(tmp_path / "b", **{"train.steps": 4})),
        resume=tmp_path / "b" / "t",
    )
    assert resumed.summary["resumed_from_step"] == 2
    a, b = _losses(full.run_dir), _losses(resumed.run_dir)
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-7)
        assert b[step]["reward_mean"] == a[step]["reward_mean"]
