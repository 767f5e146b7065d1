"""A rollout side that fails samples: held-out evaluation counts them wrong, a step with no
sample left is counted and drawn again, and a side that fails every step stops the run in one
line (never a ZeroDivisionError or an empty-batch traceback)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlpost.config import RECIPES_DIR, load_config
from rlpost.envs.examples import calc_agent
from rlpost.pipeline.loop import EMPTY_STEPS_IN_A_ROW, TrainingStopped, train

CALLS = itertools.count()
ROOT = Path(__file__).resolve().parents[2]


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
        "agent.harness.name": f"tests.integration.test_failed_rollouts:{entry}",
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


def _train_cli(tmp_path, *harness: str) -> subprocess.CompletedProcess:
    over = {
        "run.output_dir": tmp_path, "run.name": "t", "agent.harness.demonstrations": "null",
        "agent.harness.workers": 4, "sft.steps": 0, "train.steps": 4,
        "rollout.prompts_per_step": 8, "rollout.n": 2, "rollout.max_tokens": 8,
        "train.mini_batch_size": 16, "train.micro_batch_size": 16, "eval.limit": 2, "eval.samples": 1,
        "observe.progress": "false", "observe.plot": "false", "checkpoint.every": 0,
    }  # fmt: skip
    args = [*(f"{k}={v}" for k, v in over.items()), *harness]
    tmp_path.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", str(RECIPES_DIR / "agent_blackbox.yaml"), *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_a_failing_harness_says_why_in_the_stop_line(tmp_path):
    """16 of 16 sessions fail each step: the run's last line carries the first one's reason (a
    command's exit status and last stderr line; a function's exception), with no traceback."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:  # a command's /tmp is its own
        secret = Path(scratch) / "secret"
        secret.write_text("x")
        secret.chmod(0)  # unreadable under the command's own uid
        command = f"agent.harness.command=[cat,{secret}]"
        for i, (harness, needle) in enumerate((
            (["agent.harness.name=command", command],
             f"harness command exited 1: cat: {secret}: Permission denied"),
            (["agent.harness.name=tests.integration.test_failed_rollouts:always_fails"],
             "RuntimeError: harness down"),
        )):  # fmt: skip
            proc = _train_cli(tmp_path / str(i), *harness)
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            last = proc.stderr.strip().splitlines()[-1]
            assert "every sample of 8 prompts failed (harness_failed=16" in last, proc.stderr
            assert needle in last and "--resume" in last, last
