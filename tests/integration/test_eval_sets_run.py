"""A run with evaluation sets: eval/<set>/<metric> at the start, every eval.every steps and
at the end, per-set start/end and the eval wall time in summary.json, and ``rlpost eval`` on
the checkpoint reporting the same numbers."""

from __future__ import annotations

import json

from rlpost.cli import main
from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides

METRICS = ["mean@2", "pass@4", "maj@4", "greedy"]


def _sets(tmp_path) -> str:
    f = tmp_path / "words.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n" for w in "abcde"))
    return json.dumps(
        [
            {"name": "sums", "task": {"name": "arith", "max_operand": 9, "eval_size": 6},
             "metrics": METRICS},
            {"name": "words", "task": {"name": "file", "eval_path": str(f)}, "reward": [{"name": "exact_match"}],
             "metrics": ["pass@1", "greedy"], "samples": 3},
        ]
    )  # fmt: skip


def test_eval_sets_run_and_rlpost_eval_agree(tmp_path, capsys):
    sets = _sets(tmp_path)
    over = {"eval.sets": sets, "train.steps": 2, "eval.every": 1, "checkpoint.every": 2}
    result = train(load_config(None, small_overrides(tmp_path, **over)))
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in rows if "eval/sums/pass@4" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]  # start, eval.every, end
    for r in evals:
        assert r["eval/sums/problems"] == 6 and r["eval/words/problems"] == 5
        for m in METRICS:
            assert 0.0 <= r[f"eval/sums/{m}"] <= 1.0
        assert "eval/words/maj@4" not in r and "eval_accuracy" not in r
    s = result.summary
    assert set(s["eval_sets"]) == {"sums", "words"}
    assert s["eval_sets"]["sums"]["pass@4_start"] == evals[0]["eval/sums/pass@4"]
    assert s["eval_sets"]["words"]["greedy_end"] == evals[-1]["eval/words/greedy"]
    assert s["eval_seconds"] > 0 and 0 < s["eval_share"] < 1
    report = json.loads((result.run_dir / "data_report.json").read_text())
    assert report["eval"]["sources"]["words"]["eval_rows"] == 5
    assert report["eval"]["sources"]["words"]["in_train"] == 0  # no training row says "say a:"
    assert 0 <= report["eval"]["sources"]["sums"]["in_train"] <= 6  # arith sums the run trains on

    capsys.readouterr()
    model = result.run_dir / "checkpoints" / "step_2" / "model"
    over = {"eval.sets": sets, "model.path": model, "sft.steps": 0}
    assert main(["eval", *small_overrides(tmp_path, **over)]) == 0
    printed = dict(
        line.split(": ") for line in capsys.readouterr().out.splitlines() if ": " in line
    )
    for key, value in evals[-1].items():
        if key.startswith("eval/"):
            assert float(printed[key]) == round(value, 4) or abs(float(printed[key]) - value) < 1e-4
