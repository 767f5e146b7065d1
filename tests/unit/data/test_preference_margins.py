"""Pairs files with a margin column, and the per-split reports ``rlpost rm`` writes (CPU)."""

from __future__ import annotations

import json

import pytest

from rlpost.config import load_config
from rlpost.data.files import DataError
from rlpost.data.preferences import load_pairs_reported, load_preference_file


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_margins_are_read_and_bad_ones_reported_with_file_and_line(tmp_path):
    good = {"prompt": "p", "chosen": "a", "rejected": "b", "m": 1.5}
    path = _write(
        tmp_path / "p.jsonl",
        [good, {**good, "m": "big"}, {**good, "m": True}, {**good, "m": None}, {**good, "m": 0}],
    )
    pairs, report = load_preference_file(path, margin_field="m", on_bad_row="skip")
    assert [p.margin for p in pairs] == [1.5, 0.0]
    assert report.skipped_by_reason == {"bad_margin": 3}
    assert report.problems[0].startswith(f"{path}:2: field 'm' is missing or not a finite")
    with pytest.raises(DataError, match=f"{path}:2: "):
        load_preference_file(path, margin_field="m")
    plain, _ = load_preference_file(_write(tmp_path / "q.jsonl", [good]))
    assert plain[0].margin is None  # no margin_field: no margin, whatever the row holds


def test_reports_per_split(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(10)]
    path = _write(tmp_path / "p.jsonl", [*rows, "{bad"])
    over = ["data.task=file", f"data.task.train_path={path}", "data.task.eval_fraction=0.2"]
    d = load_config(None, [*over, "data.on_bad_row=skip"]).data
    train, held, reports = load_pairs_reported(d, seed=0)
    assert (len(train), len(held)) == (8, 2)
    assert reports["train"].rows == 8 and reports["train"].skipped == 1
    assert reports["eval"].rows == 2
    builtin = load_config(None, ["data.task=prefs", "data.task.eval_size=5"]).data
    train, held, reports = load_pairs_reported(builtin, seed=0)
    assert len(held) == 5 and reports["eval"].rows == 5 and reports["train"].rows == len(train)
