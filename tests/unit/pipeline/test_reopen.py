"""Resuming says where it starts and drops metric rows the resume will replay (CPU)."""

from __future__ import annotations

import json

import pytest

from rlpost.config import ConfigError
from rlpost.pipeline.rundir import reopen_run_dir
from rlpost.statefile import save_state
from rlpost.train.checkpoint import TRAINER_STATE, save_checkpoint


def test_rows_after_the_checkpoint_are_dropped(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()

    def parts(d):
        (d / "model").mkdir()
        (d / "model" / "config.json").write_text("{}")
        save_state({}, d / TRAINER_STATE)

    save_checkpoint(run, 2, parts, {})
    (run / "config.yaml").write_text("{}")
    rows = [{"step": s, "loss": s} for s in (0, 1, 2, 3, 4)]
    lines = [json.dumps(r) for r in rows] + ['{"step": 5, "lo']  # torn last line of a kill
    (run / "metrics.jsonl").write_text("\n".join(lines))
    reopen_run_dir(run)
    assert f"resuming {run} from step 2" in capsys.readouterr().err
    kept = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in kept] == [0, 1, 2]


def test_a_directory_that_is_no_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        reopen_run_dir(tmp_path)
