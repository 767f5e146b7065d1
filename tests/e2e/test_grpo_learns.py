"""A shortened default job must learn: training reward and held-out accuracy both rise."""

import pytest

from rlpost.cli import DEFAULT_RECIPE
from rlpost.config import load_config
from rlpost.pipeline.loop import train


@pytest.mark.slow
def test_default_recipe_learns(tmp_path):
    cfg = load_config(
        DEFAULT_RECIPE,
        [
            f"run.output_dir={tmp_path}",
            "train.steps=100",
            "eval.every=0",
            "eval.limit=300",
            "checkpoint.every=0",
            "observe.progress=false",
        ],
    )
    result = train(cfg)
    rewards = [h["reward_mean"] for h in result.history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    s = result.summary
    assert last > first + 0.05, (first, last)
    assert s["eval_accuracy_end"] > s["eval_accuracy_start"] + 0.05, s
