"""A run on a file with bad rows reports each of them and counts them everywhere a user looks."""

from __future__ import annotations

import json

from rlpost.cli import main
from tests.conftest import small_overrides


def test_skipped_rows_on_console_in_summary_and_metrics(tmp_path, capsys):
    f = tmp_path / "train.jsonl"
    good = [
        json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) for a in range(5) for b in range(5)
    ]
    bad = [b"{oops", b'{"prompt": "\xff1+1=", "answer": 2}', b'{"prompt": "1+2=", "answer": ""}']
    f.write_bytes(b"\n".join([*(g.encode() for g in good), *bad, ("9" * 200).encode()]) + b"\n")
    over = small_overrides(
        tmp_path,
        **{
            "data.task": "file",
            "data.task.train_path": f,
            "data.task.eval_path": f,
            "train.steps": 1,
        },
    )
    assert main(["train", *over, "data.on_bad_row=skip"]) == 0
    err = capsys.readouterr().err
    assert (
        "data train: 25 rows used, 4 skipped (empty_answer 1, invalid_json 1, not_object 1, not_utf8 1)"
        in err
    )
    assert f"{f}:26: not valid JSON" in err and f"{f}:27: not UTF-8" in err
    run = tmp_path / "t"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["train_skipped"] == 4 and summary["data"]["eval_skipped_not_utf8"] == 1
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["data_train_skipped_invalid_json"] == 1
    report = json.loads((run / "data_report.json").read_text())
    assert len(report["train"]["skipped_rows"]) == 4
