"""A run over a mixture of sources: every source's rows reported, rewards routed, and a
resume draws exactly the rows an uninterrupted run draws, per source."""

from __future__ import annotations

import json

from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides


def _sources(tmp_path) -> str:
    f = tmp_path / "words.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n" for w in "abcde"))
    return json.dumps(
        [
            {
                "name": "arith",
                "task": "arith",
                "weight": 3,
                "arith": {"max_operand": 9, "eval_size": 8},
            },
            {
                "name": "words",
                "train_path": str(f),
                "eval_path": str(f),
                "reward": [{"name": "exact_match"}],
            },
        ]
    )


def _run(tmp_path, steps: int, *, resume=None, sources: str):
    drawn: dict[int, list[str]] = {}
    over = {"data.sources": sources, "train.steps": steps}
    cfg = load_config(None, small_overrides(tmp_path, **over))
    result = train(cfg, resume=resume, on_groups=lambda s, gs: drawn.update({s: _uids(gs)}))
    return result, drawn


def _uids(groups) -> list[str]:
    return [g.prompt.uid for g in groups]


def test_mixture_run_reports_sources_and_resumes_exactly(tmp_path):
    sources = _sources(tmp_path)
    full, full_drawn = _run(tmp_path / "a", 4, sources=sources)
    every = [u for step in sorted(full_drawn) for u in full_drawn[step]]
    assert {u.split("/")[0] for u in every} == {"arith", "words"}
    report = json.loads((full.run_dir / "data_report.json").read_text())
    assert report["train"]["sources"]["words"]["train_rows"] == 5
    assert report["eval"]["sources"]["words"]["eval_rows"] == 5
    assert report["train"]["train_rows"] == report["train"]["sources"]["arith"]["train_rows"] + 5

    _run(tmp_path / "b", 2, sources=sources)
    _, resumed = _run(tmp_path / "b", 4, resume=tmp_path / "b" / "t", sources=sources)
    assert sorted(resumed) == [3, 4]
    assert resumed[3] == full_drawn[3] and resumed[4] == full_drawn[4]
