"""Starting a run never deletes an earlier one: every failing start leaves it byte for byte."""

from __future__ import annotations

import json

import pytest

from rlpost.cli import main
from tests.conftest import small_overrides


def _snapshot(root):
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def old_run(tmp_path):
    """A finished run as a user has it: config, metrics, checkpoint, summary, warm-up model."""
    run = tmp_path / "t"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_3")
    (run / "checkpoints" / "step_3" / "state.pt").write_bytes(b"state")
    (run / "sft_model").mkdir()
    (run / "sft_model" / "config.json").write_text("{}")
    (run / "config.yaml").write_text("run: {name: t}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    (run / "summary.json").write_text(json.dumps({"eval_accuracy_end": 0.5}))
    return run


def _bad_starts(tmp_path):
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"prompt": "1+1=", "answer": 2}\nnot json\n')
    no_config = tmp_path / "empty_model"
    no_config.mkdir()
    base = small_overrides(tmp_path)
    file_task = ["data.task=file", "sft.steps=0"]
    return {
        "existing run, no flag": ["train", *base],
        "existing run, sft": ["sft", *base],
        "existing run, dpo": ["dpo", f"run.output_dir={tmp_path}", "run.name=t"],
        "missing dataset": [
            "train",
            *base,
            *file_task,
            f"data.task.train_path={tmp_path}/no.jsonl",
        ],
        "bad row": ["train", *base, *file_task, f"data.task.train_path={bad_rows}", "--overwrite"],
        "missing model": ["train", *base, f"model.path={tmp_path}/none", "--overwrite"],
        "not a checkpoint": ["train", *base, f"model.path={no_config}", "--overwrite"],
        "unknown key": ["train", *base, "rollout.nn=3", "--overwrite"],
        "bad value": ["train", *base, "rollout.n=1", "--overwrite"],
        "missing eval set": [
            "train",
            *base,
            *file_task,
            f"data.task.train_path={bad_rows}",
            "data.on_bad_row=skip",
            f"data.task.eval_path={tmp_path}/no.jsonl",
            "--overwrite",
        ],
        "dpo missing model": [
            "dpo",
            f"run.output_dir={tmp_path}",
            "run.name=t",
            f"model.path={tmp_path}/none",
            "--overwrite",
        ],
    }


def test_every_failing_start_leaves_the_old_run_intact(tmp_path, old_run, capsys):
    before = _snapshot(old_run)
    for name, argv in _bad_starts(tmp_path).items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("rlpost: error: ") and err.count("\n") == 1, (name, err)
        assert _snapshot(old_run) == before, name


def test_existing_run_error_names_both_ways_out(tmp_path, old_run, capsys):
    assert main(["train", *small_overrides(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {old_run}" in err and "--overwrite" in err


def test_overwrite_replaces_the_run(tmp_path, old_run):
    assert main(["sft", *small_overrides(tmp_path, **{"sft.steps": 1}), "--overwrite"]) == 0
    assert not (old_run / "summary.json").exists()
    assert (old_run / "sft_model" / "config.json").stat().st_size > 2


def test_overwrite_never_replaces_what_is_not_a_run(tmp_path, capsys):
    """--overwrite on a directory without a run's config.yaml, or a run.name that would make
    the run directory the output directory or its parent, deletes nothing."""
    mine = tmp_path / "t"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "keep.txt").write_text("mine")
    for name in ["t", "", "..", "."]:
        over = [f"run.output_dir={tmp_path}", f"run.name={name}", "sft.steps=1"]
        assert main(["sft", *over, "--overwrite"]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "run" in err, (name, err)
    assert (mine / "notes" / "keep.txt").read_text() == "mine"


def test_a_run_never_writes_through_links_planted_in_its_directory(tmp_path):
    """A shared run directory: someone plants links at the temporary names the trainer
    writes, to a file and a directory outside it; the resumed run saves its checkpoint and
    nothing outside changes."""
    over = small_overrides(tmp_path / "out", **{"train.steps": 1, "eval.every": 0})
    assert main(["train", *over]) == 0
    run, outside = tmp_path / "out" / "t", tmp_path / "outside"
    outside.mkdir()
    (outside / "file.txt").write_text("mine")
    (outside / ".trainer_state.pt.tmp").symlink_to(outside / "file.txt")
    for name in ("checkpoints/.latest.tmp", "metrics.jsonl.tmp", ".metrics.jsonl.tmp"):
        (run / name).symlink_to(outside / "file.txt")
    (run / "checkpoints" / ".step_2.tmp").symlink_to(outside)
    before = _snapshot(outside)
    over = small_overrides(tmp_path / "out", **{"train.steps": 2, "eval.every": 0})
    assert main(["train", *over, "--resume", str(run)]) == 0
    assert _snapshot(outside) == before and sorted(p.name for p in outside.iterdir()) == [
        ".trainer_state.pt.tmp",
        "file.txt",
    ]
    assert (run / "checkpoints" / "latest").read_text() == "step_2"
