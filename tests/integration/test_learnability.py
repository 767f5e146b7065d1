"""A run that cannot learn says so: each warning fires in a run built to trigger it, in
every pipeline mode for the stale engine, and none fires on a short default-recipe run."""

from __future__ import annotations

import logging

import pytest

from rlpost.config import load_config
from rlpost.pipeline.learnability import FIRST_STEPS
from rlpost.pipeline.loop import start_workers, train
from tests.conftest import small_overrides

QUIET = {"eval.every": 0, "eval.limit": 2, "checkpoint.every": 0, "train.steps": FIRST_STEPS}


def constant_reward(sample, **_):
    """The same reward for every sample: no group has any spread."""
    return 0.5


def warnings_of(tmp_path, caplog, start=None, **extra) -> list[str]:
    caplog.clear()
    cfg = load_config(None, small_overrides(tmp_path, **{**QUIET, **extra}))
    with caplog.at_level(logging.WARNING, logger="rlpost.pipeline.learnability"):
        train(cfg, start=start)
    return [r.getMessage() for r in caplog.records if r.name == "rlpost.pipeline.learnability"]


def kinds(messages) -> list[str]:
    return sorted(m.split(":")[1].strip() for m in messages)


def test_nearly_every_response_truncated(tmp_path, caplog):
    said = warnings_of(tmp_path, caplog, **{"rollout.max_tokens": 1})
    assert "truncated responses" in kinds(said), said
    assert "truncated_frac=1.00 at step 1" in said[0] and "\n" not in said[0]


def test_every_group_without_reward_spread(tmp_path, caplog):
    const = "tests.integration.test_learnability:constant_reward"
    said = warnings_of(
        tmp_path,
        caplog,
        **{"reward.terms": f"[{{name: '{const}'}}]", "rollout.truncated_reward": "null"},
    )
    assert "no reward spread" in kinds(said), said


def disconnected(cfg, run_dir, prompts, console, *, resuming):
    """The usual workers, but the engine only stamps the version a push announces: its
    weights never change (an adapter or a push that never arrives)."""
    workers = start_workers(cfg, run_dir, prompts, console, resuming=resuming)
    engine = workers.rollout.engine
    target = getattr(engine, "scheduler", engine)

    def stamp_only(named_tensors, version):
        target.version = version

    if hasattr(engine, "scheduler"):
        target.load_weights = stamp_only
    else:
        engine.load_weights = stamp_only
    return workers


SPREAD = {
    "reward.terms": "[{name: 'tests.integration.knob_probe:spread_reward'}]",
    "rollout.truncated_reward": "null",
}


# sync mode with sync.codec=none serves the trainer's own memory (nothing to push): the bf16
# codec gives the engine its own copy, as a LoRA policy or a remote engine have (with
# sync.verify on, the sync layer itself refuses a push the engine did not take)
@pytest.mark.parametrize(
    ("mode", "extra"),
    [("sync", {"sync.codec": "bf16", "sync.verify": False}), ("one_step_off", {}), ("async", {})],
)
def test_engine_that_still_serves_the_initial_weights(tmp_path, caplog, mode, extra):
    over = {**SPREAD, **extra, "pipeline.mode": mode}
    said = warnings_of(tmp_path, caplog, start=disconnected, **over)
    stale = [m for m in said if "stale engine" in m]
    assert len(stale) == 1 and "\n" not in stale[0], said
    connected = warnings_of(tmp_path / "ok", caplog, **over)
    assert not [m for m in connected if "stale engine" in m], connected


def test_a_short_default_run_is_silent(tmp_path, caplog):
    # the default recipe's shape, after a warm-up long enough to stop and sometimes be right
    said = warnings_of(
        tmp_path,
        caplog,
        **{
            "sft.steps": 150,
            "rollout.max_tokens": 6,
            "model.tiny.hidden_size": 64,
            "model.tiny.intermediate_size": 256,
        },
    )
    assert said == []
