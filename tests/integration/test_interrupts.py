"""SIGTERM / Ctrl-C: the run stops cleanly, says how to resume, and the resume replays nothing."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

from rlpost.cli import main
from rlpost.pipeline.console import Console
from tests.conftest import small_overrides


def _training_steps(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def _wait_for_a_step(proc, run_dir):
    while proc.poll() is None:  # no time limit asserted: the test's own timeout guards a hang
        if (run_dir / "metrics.jsonl").is_file() and _training_steps(run_dir):
            return
        time.sleep(0.2)


def test_sigterm_checkpoints_and_the_printed_command_resumes(tmp_path):
    over = small_overrides(
        tmp_path, **{"train.steps": 40, "checkpoint.every": 0, "eval.every": 0, "eval.limit": 4}
    )
    run_dir = tmp_path / "t"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlpost.cli", "train", *over],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _wait_for_a_step(proc, run_dir)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = _training_steps(run_dir)[-1]
    assert stopped < 40 and (run_dir / "checkpoints" / f"step_{stopped}" / "state.pt").is_file()
    assert f"checkpoint at step {stopped}; continue with:" in err
    summary = run_dir / "summary.json"
    assert json.loads(summary.read_text())["steps"] == stopped  # the step reached, not 40
    command = shlex.split(err.strip().splitlines()[-1])
    assert command[:2] == ["rlpost", "train"] and command[-2:] == ["--resume", str(run_dir)]
    resumed = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", *command[1:]], capture_output=True, text=True, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {run_dir} from step {stopped}" in resumed.stderr
    assert _training_steps(run_dir) == list(range(1, 41))  # each step once
    assert json.loads(summary.read_text())["steps"] == 40


def test_ctrl_c_in_the_warm_up_saves_it_and_resume_finishes_it(tmp_path, monkeypatch, capsys):
    sent = []

    def advance(self, task, info=""):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Console, "advance", advance)
    over = small_overrides(tmp_path, **{"sft.steps": 4, "train.steps": 1})
    assert main(["train", *over]) == 128 + signal.SIGINT
    run_dir = tmp_path / "t"
    err = capsys.readouterr().err
    saved = run_dir / "sft_state" / "checkpoints" / "step_1"  # the RL checkpoint format
    assert "stopped during the warm-up" in err and (saved / "trainer_state.pt").is_file()
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert "resuming" in capsys.readouterr().err
    assert (run_dir / "sft_model" / "config.json").is_file() and not (
        run_dir / "sft_state"
    ).exists()
    assert len(json.loads((run_dir / "sft_losses.json").read_text())) == 4
