"""Overlapped modes (one_step_off, async): the staleness bound holds for every trained token,
no prompt is lost or trained twice across a stop and resume, and a lost rollout worker stops
the run in one line with a checkpoint (CPU)."""

from __future__ import annotations

import threading

import pytest

from rlpost.cluster import starter
from rlpost.config import load_config
from rlpost.pipeline.loop import TrainingStopped, train


def _cfg(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.threads=1",
            "sft.steps=40",
            "sft.batch_size=32",
            "train.steps=6",
            "rollout.prompts_per_step=8",
            "rollout.n=4",
            "rollout.max_tokens=6",
            "train.mini_batch_size=32",
            "train.micro_batch_size=32",
            "eval.limit=8",
            "eval.every=0",
            "checkpoint.every=1",
            "observe.progress=false",
            "observe.plot=false",
            "cluster.backend=local",
            *extra,
        ],
    )


class Trained:
    """Records, for every step, the prompts trained and each sample's oldest token version."""

    def __init__(self) -> None:
        self.prompts: dict[int, list[str]] = {}
        self.lags: dict[int, list[int]] = {}

    def __call__(self, step: int, groups) -> None:
        self.prompts[step] = [g.prompt.uid for g in groups]
        version = step - 1  # the weights this step trains (one trainer step per RL step)
        self.lags[step] = [
            version - min(c.versions_per_token()) for g in groups for c in g.completions
        ]


@pytest.mark.parametrize(("mode", "eta"), [("one_step_off", 1), ("async", 2)])
def test_staleness_bound_holds_for_every_trained_token(tmp_path, mode, eta):
    seen = Trained()
    cfg = _cfg(tmp_path, mode, f"pipeline.mode={mode}", f"pipeline.max_staleness={eta}")
    result = train(cfg, on_groups=seen)
    lags = [lag for step in sorted(seen.lags) for lag in seen.lags[step]]
    assert lags and max(lags) <= eta  # the bound, over every trained sample's oldest token
    assert max(lags) >= 1  # and the rollout really ran ahead of the trainer
    assert all(h["sample_lag_max"] <= eta for h in result.history)
    assert result.summary["completions_per_second"] > 0 and result.summary["rl_seconds"] > 0


def test_stop_and_resume_trains_every_prompt_exactly_once(tmp_path):
    whole = Trained()
    train(
        _cfg(tmp_path, "whole", "pipeline.mode=async", "pipeline.max_staleness=2"), on_groups=whole
    )

    first, stop = Trained(), threading.Event()

    def stop_after_three(step, groups):
        first(step, groups)
        if step == 3:
            stop.set()  # the run ends after this step, with batches generated ahead of it

    cfg = _cfg(tmp_path, "cut", "pipeline.mode=async", "pipeline.max_staleness=2")
    cut = train(cfg, on_groups=stop_after_three, stop=stop)
    assert len(cut.history) == 3
    rest = Trained()
    train(cfg, resume=cut.run_dir, on_groups=rest)
    resumed = {**first.prompts, **rest.prompts}
    assert sorted(resumed) == sorted(whole.prompts) == [1, 2, 3, 4, 5, 6]
    assert [resumed[s] for s in sorted(resumed)] == [
        whole.prompts[s] for s in sorted(whole.prompts)
    ]


def test_a_lost_rollout_worker_stops_the_run_in_one_line_with_a_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, "lost", "pipeline.mode=async", "cluster.backend=process", "train.steps=8")
    workers = {}
    start = starter(cfg)

    def keep(*args, **kwargs):
        workers["w"] = start(*args, **kwargs)
        return workers["w"]

    def kill_at_two(step, groups):
        if step == 2:
            workers["w"].rollout.kill()

    with pytest.raises(TrainingStopped) as err:
        train(cfg, start=keep, on_groups=kill_at_two)
    message = str(err.value)
    assert "rollout stopped" in message and "--resume" in message and "\n" not in message
    latest = (tmp_path / "lost" / "checkpoints" / "latest").read_text()
    assert int(latest.split("_")[1]) >= 2


def test_a_crash_and_resume_trains_every_prompt_exactly_once(tmp_path):
    # A crash (no final checkpoint) in the middle of step 4: the resume starts from the
    # step-3 checkpoint, whose pending prompts (generated ahead, not trained) come first.
    whole = Trained()
    train(
        _cfg(tmp_path, "whole", "pipeline.mode=async", "pipeline.max_staleness=2"), on_groups=whole
    )
    first = Trained()

    def crash_at_four(step, groups):
        if step == 4:
            raise RuntimeError("machine lost")
        first(step, groups)

    cfg = _cfg(tmp_path, "crash", "pipeline.mode=async", "pipeline.max_staleness=2")
    with pytest.raises(RuntimeError, match="machine lost"):
        train(cfg, on_groups=crash_at_four)
    rest = Trained()
    train(cfg, resume=tmp_path / "crash", on_groups=rest)
    assert sorted(first.prompts) == [1, 2, 3] and sorted(rest.prompts) == [4, 5, 6]
    resumed = {**first.prompts, **rest.prompts}
    assert [resumed[s] for s in range(1, 7)] == [whole.prompts[s] for s in range(1, 7)]


def test_a_lost_trainer_process_stops_in_one_line_and_the_last_checkpoint_stands(tmp_path):
    cfg = _cfg(tmp_path, "trainer", "pipeline.mode=async", "cluster.backend=process")
    workers = {}
    start = starter(cfg)

    def keep(*args, **kwargs):
        workers["w"] = start(*args, **kwargs)
        return workers["w"]

    def kill_at_three(step, groups):
        if step == 3:
            workers["w"].trainer.kill()

    with pytest.raises(TrainingStopped) as err:
        train(cfg, start=keep, on_groups=kill_at_three)
    message = str(err.value)
    assert "trainer worker lost" in message and "--resume" in message and "\n" not in message
    assert (tmp_path / "trainer" / "checkpoints" / "latest").read_text() == "step_2"
