"""A part from the user's own file, for each kind: it trains, and its mistakes are one line.

Each part lives in one file under examples/parts/ (the mistakes: tests/integration/user_parts/),
outside the package, and is named in the config as ``path/to/file.py:object``; nothing in
rlpost/ names it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.cli import main
from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides

PARTS = Path(__file__).resolve().parents[2] / "examples" / "parts"  # the documented examples
BAD = Path(__file__).parent / "user_parts"  # the mistakes


def _train(tmp_path, **over):
    extra = {"train.steps": 2, "sft.steps": 0, "eval.every": 0, "checkpoint.every": 0} | over
    result = train(load_config(None, small_overrides(tmp_path, **extra)))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


@pytest.mark.parametrize(
    "over",
    [
        {"algo.advantage.name": f"{PARTS}/median_baseline.py:median_baseline",
         "algo.advantage.scale": 2.0},
        {"algo.loss.name": f"{PARTS}/clipped_loss.py:clipped", "algo.loss.clip": 0.3},
        {"algo.kl.estimator": f"{PARTS}/kl_squared.py:half_square", "algo.kl.beta": 0.1},
        {"algo.loss_agg_mode": f"{PARTS}/seq_mean.py:row_mean"},
    ],
    ids=["advantage", "loss", "kl", "aggregation"],
)  # fmt: skip
def test_a_user_algorithm_part_trains_two_steps(tmp_path, over):
    rows = _train(tmp_path, **over)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN


def test_a_user_loss_gets_its_declared_params(tmp_path):
    rows = _train(tmp_path, **{"algo.loss.name": f"{PARTS}/clipped_loss.py:clipped"})
    assert rows[0]["clip"] == pytest.approx(0.2)  # the params class's default, logged by the loss


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``rlpost train ARGS`` in this process: its exit code and stderr. A traceback would
    raise here rather than return."""
    code = main(["train", *args, "sft.steps=0"])
    return code, capsys.readouterr().err


BROKEN = f"{BAD}/broken_parts.py"


@pytest.mark.parametrize(
    ("key", "fn", "says"),
    [
        ("algo.loss.name", "no_params", "does not take the call of a policy loss"),
        ("algo.loss.name", "says_yes", "returned str where PolicyLossOutput"),
        ("algo.loss.name", "raises", "raised ZeroDivisionError: division by zero"),
        ("algo.advantage.name", "nan_advantage", "returned a non-finite advantages"),
        ("algo.kl.estimator", "wrong_shape_kl", "returned KL of shape (4,), expected (4, 6)"),
    ],
)
def test_a_mistake_in_a_user_algorithm_part_is_one_line(capsys, tmp_path, key, fn, says):
    code, err = _cli(capsys, f"{key}={BROKEN}:{fn}", f"run.output_dir={tmp_path}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert says in lines[0] and f"{fn} (" in lines[0] and "broken_parts.py:" in lines[0]
    assert "dummy batch of 4 rows" in lines[0] or "does not take" in lines[0]
    assert not (tmp_path / "t").exists()  # refused before any work


def test_a_missing_user_file_or_object_is_one_line(capsys):
    code, err = _cli(capsys, "algo.loss.name=nowhere.py:fn")
    assert code == 2 and "config algo.loss.name=nowhere.py:fn: no file" in err
    code, err = _cli(capsys, f"algo.loss.name={PARTS}/clipped_loss.py:clipt")
    assert code == 2 and "has no 'clipt'" in err


def test_a_user_parts_declared_params_are_checked_at_load(capsys):
    code, err = _cli(capsys, f"algo.loss.name={PARTS}/clipped_loss.py:clipped", "algo.loss.clip=x")
    assert code == 2 and err.startswith("rlpost: error: config algo.loss.clip='x': Input should")


def test_the_cli_says_a_user_mistake_in_one_line_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", f"algo.loss.name={BROKEN}:raises"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "raises (" in proc.stderr


REWARDS = f"{BAD}/rewards.py"


def test_a_user_reward_environment_data_task_and_engine_train_two_steps(tmp_path, capsys):
    from rlpost.registry import import_object

    engine = f"{PARTS}/counting_engine.py:counting"
    over = {
        "reward.terms": f"[{{name: '{PARTS}/reward.py:exact', bonus: 0.5}}]",
        "agent.env": f"{PARTS}/echo_env.py:Echo",
        "data.task": f"{{name: '{PARTS}/data_task.py:sums', n: 24, held: 4}}",
        "rollout.engine": engine,
        "rollout.max_tokens": 8,
        "sft.steps": 1,
    }
    rows = _train(tmp_path, **over)
    assert [r["step"] for r in rows] == [1, 2]
    assert import_object(engine).__globals__["SAMPLED"]  # the user's engine sampled
    err = capsys.readouterr().err  # Echo has no demonstration(): the warm-up says so
    assert "echo_env.py:Echo has no demonstration(): the warm-up teaches no tool use" in err


def _reward_run(capsys, tmp_path, fn: str, *extra: str) -> tuple[int, str]:
    args = small_overrides(tmp_path, **{"train.steps": 1, "eval.every": 0})
    return _cli(capsys, *args, f"reward.terms=[{{name: '{REWARDS}:{fn}'}}]", *extra)


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        ("wrong_signature", "does not take params [] (too many positional arguments)"),
        ("says_yes", "returned 'yes', not a float or None on the sample"),
        ("raises", "raised KeyError: 'score' on the sample"),
        ("nan", "returned nan on the sample"),
    ],
)
def test_a_mistake_in_a_user_reward_is_one_line_before_the_warm_up(capsys, tmp_path, fn, says):
    code, err = _reward_run(capsys, tmp_path, fn, "sft.steps=5")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert says in lines[0] and f"{fn} (" in lines[0] and "rewards.py:" in lines[0]
    assert not (tmp_path / "t" / "sft_model").exists()  # before the warm-up


def test_a_reward_that_never_applies_stops_the_run_in_one_line(capsys, tmp_path):
    code, err = _reward_run(capsys, tmp_path, "never_applies")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "every term returned None (not applicable) for all" in err and "never_applies (" in err


def test_a_user_reward_failing_at_run_time_names_the_sample_and_the_resume(capsys, tmp_path):
    code, err = _reward_run(capsys, tmp_path, "fails_later")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "fails_later (" in err and "raised ValueError: cannot parse the completion" in err
    assert "on the sample '" in err and f"rlpost train --resume {tmp_path / 't'}" in err


def test_an_environment_whose_step_returns_none_is_one_line(capsys, tmp_path):
    args = small_overrides(tmp_path, **{"train.steps": 1})
    code, err = _cli(capsys, *args, f"agent.env={BAD}/echo_env.py:SilentEcho")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "environment SilentEcho (" in lines[0] and "echo_env.py:" in lines[0]
    assert "step() returned NoneType, not a StepResult, on the turn '2'" in lines[0]


def test_a_user_loss_failing_at_run_time_stops_in_one_line_with_the_resume(capsys, tmp_path):
    args = small_overrides(tmp_path, **{"train.steps": 2, "eval.every": 0})
    code, err = _cli(capsys, *args, f"algo.loss.name={BAD}/late_loss.py:late")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert "late (" in lines[0] and "late_loss.py:" in lines[0]
    assert "raised ValueError: cannot handle a real batch" in lines[0]
    assert f"rlpost train --resume {tmp_path / 't'}" in lines[0]
