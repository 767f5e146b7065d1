"""The real loop on a tiny model: artifacts, resume exactness, guards on bad input."""

import json
import math
import threading

import pytest

from rlpost.config import load_config
from rlpost.models.loading import load_causal_lm, load_tokenizer
from rlpost.pipeline.console import Console
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
    # The last checkpoint's model is an ordinary HF directory, tokenizer included.
    model_dir = run / "checkpoints" / "step_3" / "model"
    assert load_tokenizer(model_dir)("1+2=")["input_ids"] and load_causal_lm(model_dir) is not None
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


def test_partial_rollout_trains_every_prompt_exactly_once(tmp_path):
    """Carried groups train in a later step; the last step waits for all; nothing is lost."""
    over = {
        "rollout.partial": True,
        "rollout.partial_fraction": 0.5,
        "rollout.length_aware": True,
        "rollout.max_tokens": 12,
        "sft.steps": 60,  # long enough to learn to stop, so lengths spread out
        "train.steps": 4,
        "eval.every": 0,
        "checkpoint.every": 0,
    }
    result = train(load_config(None, small_overrides(tmp_path, **over)))
    rows = _losses(result.run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    assert sum(r["prompts"] for r in rows.values()) == 4 * 4  # steps * prompts_per_step
    assert any(r["carried_groups"] > 0 for r in rows.values())
    carried_into = [s for s in (2, 3, 4) if rows[s - 1]["carried_groups"] > 0]
    assert carried_into and all(rows[s]["sample_lag_max"] >= 1 for s in carried_into)
    assert rows[4]["carried_groups"] == 0 and rows[4]["partial_done_fraction"] == 1.0
    for r in rows.values():
        assert math.isfinite(r["loss"]) and 0 <= r["sample_lag"] <= r["sample_lag_max"]


def test_resume_with_partial_rollout_continues_the_carried_groups(tmp_path):
    over = {
        "rollout.partial": True,
        "rollout.partial_fraction": 0.5,
        "rollout.max_tokens": 12,
        "sft.steps": 60,
        "eval.every": 0,
    }
    full = train(load_config(None, small_overrides(tmp_path / "a", **over, **{"train.steps": 4})))
    # A 4-step run interrupted after step 2 (the stop event ends it there, carried groups saved).
    stop = threading.Event()
    cfg = load_config(None, small_overrides(tmp_path / "b", **over, **{"train.steps": 4}))

    class StopAfter(Console):
        def update(self, step, metrics):
            super().update(step, metrics)
            if step == 2:
                stop.set()

    train(cfg, console=StopAfter(enabled=False), stop=stop)
    resumed = train(cfg, resume=tmp_path / "b" / "t")
    a, b = _losses(full.run_dir), _losses(resumed.run_dir)
    assert a[2]["carried_groups"] > 0  # the checkpoint held unfinished groups
    for step in (3, 4):
        assert b[step]["prompts"] == a[step]["prompts"]
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-7)
