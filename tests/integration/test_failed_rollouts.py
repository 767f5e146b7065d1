"""A rollout side that fails samples: held-out evaluation counts them wrong, a step with no
sample left is counted and drawn again, and a side that fails every step stops the run in one
line (never a ZeroDivisionError or an empty-batch traceback)."""

from __future__ import annotations

import itertools
import json

import pytest

from rlpost.config import RECIPES_DIR, load_config
from rlpost.envs.examples import calc_agent
from rlpost.pipeline.loop import EMPTY_STEPS_IN_A_ROW, TrainingStopped, train

CALLS = itertools.count()


def always_fails(prompt, base_url):
    raise RuntimeError("harness down")


def fails_the_first_sessions(prompt, base_url, api_key):
    """The first 10 sessions fail (held-out evaluation and the first step's rollout), then
    the recipe's own agent runs."""
    if next(CALLS) < 10:
        raise RuntimeError("harness warming up")
    return calc_agent.run(prompt, base_url, api_key)


def _config(tmp_path, entry: str, steps: int = 2):
    over = {
        "run.output_dir": tmp_path, "run.name": "t",
        "agent.harness.entry": f"tests.integration.test_failed_rollouts:{entry}",
        "agent.harness.demonstrations": "null", "agent.harness.workers": 2,
        "sft.steps": 2, "train.steps": steps, "rollout.prompts_per_step": 2, "rollout.n": 2,
        "rollout.max_tokens": 8, "train.mini_batch_size": 4, "train.micro_batch_size": 4,
        "eval.limit": 2, "eval.samples": 2, "eval.temperature": 1.0,
        "observe.progress": "false", "observe.plot": "false", "checkpoint.every": 0,
    }  # fmt: skip
    return load_config(RECIPES_DIR / "agent_blackbox.yaml", [f"{k}={v}" for k, v in over.items()])


@pytest.mark.slow
def test_a_harness_that_fails_every_session_stops_the_run_in_one_line(tmp_path):
    with pytest.raises(TrainingStopped) as caught:
        train(_config(tmp_path, "always_fails"))
    why = str(caught.value)
    assert "\n" not in why and "every sample of 2 prompts failed" in why
    assert f"{EMPTY_STEPS_IN_A_ROW} steps in a row" in why and "--resume" in why
    rows = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "eval_accuracy" in r)
    assert first["eval_accuracy"] == 0.0 and first["eval_dropped"] == 4  # 2 problems x 2


@pytest.mark.slow
def test_an_empty_step_is_counted_and_drawn_again(tmp_path):
    global CALLS
    CALLS = itertools.count()  # the count starts with this run
    result = train(_config(tmp_path, "fails_the_first_sessions"))
    assert [h["step"] for h in result.history] == [1, 2]  # both steps trained, none skipped
    assert all(h["completions"] > 0 for h in result.history)
    rows = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("guard_empty_step", 0) >= 1 for r in rows), rows
