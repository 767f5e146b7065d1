"""A start reads each data file once: the input check loads it, and the run trains on that."""

from __future__ import annotations

import json
from collections import Counter

from rlpost.cli import main
from rlpost.data import sources
from tests.conftest import small_overrides


def _files(tmp_path):
    rows = [
        json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) for a in range(5) for b in range(5)
    ]
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("\n".join(rows[:20]) + "\n")
    held_out.write_text("\n".join(rows[20:]) + "\n")
    return train, held_out


def _counting(monkeypatch) -> Counter:
    reads: Counter = Counter()
    real = sources.load_prompt_file

    def counted(path, **kwargs):
        reads[str(path)] += 1
        return real(path, **kwargs)

    monkeypatch.setattr(sources, "load_prompt_file", counted)
    return reads


def test_train_reads_each_data_file_once(tmp_path, monkeypatch):
    train, held_out = _files(tmp_path)
    reads = _counting(monkeypatch)
    over = small_overrides(
        tmp_path,
        **{"data.task": "file", "data.task.train_path": train, "data.task.eval_path": held_out},
        **{"train.steps": 1, "sft.steps": 1},
    )
    assert main(["train", *over]) == 0
    assert reads == {str(train): 1, str(held_out): 1}
    # the prompts the run used are the ones that one read produced
    report = json.loads((tmp_path / "t" / "data_report.json").read_text())
    assert report["train"]["train_rows"] == 20 and report["eval"]["eval_rows"] == 5


def test_resume_reads_each_data_file_once(tmp_path, monkeypatch):
    train, held_out = _files(tmp_path)
    over = small_overrides(
        tmp_path,
        **{"data.task": "file", "data.task.train_path": train, "data.task.eval_path": held_out},
        **{"train.steps": 1, "sft.steps": 0},
    )
    assert main(["train", *over]) == 0
    reads = _counting(monkeypatch)
    more = [o for o in over if not o.startswith("train.steps=")] + ["train.steps=2"]
    assert main(["train", *more, "--resume", str(tmp_path / "t")]) == 0
    assert reads == {str(train): 1, str(held_out): 1}
