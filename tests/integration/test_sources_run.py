"""A run over a mixture of sources: every source's rows reported, rewards routed, and a
resume draws exactly the rows an uninterrupted run draws, per source."""

from __future__ import annotations

import json

import pytest

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
                "task": {"name": "arith", "max_operand": 9, "eval_size": 8},
                "weight": 3,
            },
            {
                "name": "words",
                "task": {"name": "file", "train_path": str(f), "eval_path": str(f)},
                "reward": [{"name": "exact_match"}],
            },
        ]
    )


def _run(tmp_path, steps: int, *, resume=None, sources: str, **extra):
    drawn: dict[int, list[str]] = {}
    over = {"data.sources": sources, "train.steps": steps, **extra}
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

    rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    for r in steps:
        shares = r["source/arith/prompts"] + r.get("source/words/prompts", 0.0)
        assert shares == r["prompts"]  # every trained group counted under its source
        for key in ("reward_mean", "accuracy", "response_length_mean", "truncated_frac"):
            assert 0.0 <= r[f"source/arith/{key}"] <= (1.0 if key != "response_length_mean" else 4)
    assert any("source/words/zero_spread_frac" in r for r in steps)
    assert "reward_count/words:exact_match/invalid" in steps[0]

    _run(tmp_path / "b", 2, sources=sources)
    _, resumed = _run(tmp_path / "b", 4, resume=tmp_path / "b" / "t", sources=sources)
    assert sorted(resumed) == [3, 4]
    assert resumed[3] == full_drawn[3] and resumed[4] == full_drawn[4]


def test_reasoning_gym_sources_train_with_their_own_reward(tmp_path):
    pytest.importorskip("reasoning_gym")
    sources = [
        {
            "name": "arith",
            "task": {"name": "arith", "max_operand": 9, "eval_size": 8},
            "weight": 2,
        },
        {
            "name": "legs",
            "task": {
                "name": "reasoning_gym",
                "task": "leg_counting",
                "train_size": 30,
                "eval_size": 4,
            },
            "prompt_template": "{prompt} <answer>",
            "reward": [{"name": "reasoning_gym", "extract": "last_line"}],
        },
    ]
    long = {"model.tiny.max_position_embeddings": 512}  # its questions run to ~300 characters
    result, drawn = _run(tmp_path, 2, sources=json.dumps(sources), **long)
    assert any(u.startswith("legs/leg_counting:") for step in drawn.values() for u in step)
    report = json.loads((result.run_dir / "data_report.json").read_text())
    legs = report["train"]["sources"]["legs"]
    assert legs["train_rows"] == 30 and legs["unique"] == 34 and legs["short"] == 0
    assert report["eval"]["sources"]["legs"]["eval_rows"] == 4
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    last = [r for r in rows if "loss" in r][-1]
    assert "reward_count/legs:reasoning_gym/scorer_errors" in last
