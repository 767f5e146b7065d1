"""Per-source step metrics, computed by hand on a small batch."""

from __future__ import annotations

import pytest

from rlpost.observe.metrics import DuplicateMetric, merge_metrics
from rlpost.pipeline.source_metrics import PREFIX, source_metrics
from rlpost.types import Completion, Group, Prompt


def _group(source: str, scores: list[float], lengths: list[int], cut: int = 0) -> Group:
    completions = [
        Completion([1], [2] * n, [0.0] * n, "length" if i < cut else "stop", 0, 0)
        for i, n in enumerate(lengths)
    ]
    return Group(Prompt("p", source=source), completions, scores=scores)


def sources_in(row: dict) -> list[str]:
    """The source names of a metrics row's ``source/<name>/...`` keys, sorted."""
    return sorted({k[len(PREFIX) :].rsplit("/", 1)[0] for k in row if k.startswith(PREFIX)})


def test_each_source_gets_its_own_numbers():
    groups = [
        _group("a", [1.0, 0.0], [2, 4], cut=1),
        _group("b", [0.2, 0.2], [3, 3]),
        _group("a", [1.0, 1.0], [6, 8]),
    ]
    m = source_metrics(groups)
    assert m["source/a/reward_mean"] == pytest.approx(0.75)
    assert m["source/a/accuracy"] == 0.75 and m["source/b/accuracy"] == 0.0
    assert m["source/a/response_length_mean"] == 5.0 and m["source/b/response_length_mean"] == 3.0
    assert m["source/a/truncated_frac"] == 0.25 and m["source/b/truncated_frac"] == 0.0
    assert m["source/a/zero_spread_frac"] == 0.5 and m["source/b/zero_spread_frac"] == 1.0
    assert m["source/a/prompts"] == 2.0 and m["source/b/prompts"] == 1.0
    assert sources_in(m) == ["a", "b"]


def test_one_source_runs_have_none_and_keys_have_one_owner():
    assert source_metrics([_group("", [1.0, 0.0], [2, 2])]) == {}
    m = source_metrics([_group("a", [1.0, 0.0], [2, 2])])
    with pytest.raises(DuplicateMetric):
        merge_metrics(m, {"source/a/accuracy": 0.0})


def test_report_draws_every_source_curve(tmp_path):
    from rlpost.observe import Recorder
    from rlpost.observe.report import SOURCE_PLOTS, write_report

    with Recorder(tmp_path) as rec:
        for step in (1, 2, 3):
            groups = [_group("arith", [1.0, 0.0], [2, 3]), _group("legs", [0.0, 0.0], [5, 5])]
            rec.record(step, {"reward_mean": 0.25, **source_metrics(groups)})
    page = write_report(tmp_path).read_text()
    for title, _ in SOURCE_PLOTS:
        assert f'<img alt="{title}' in page
    plain = tmp_path / "plain"
    with Recorder(plain) as rec:
        rec.record(1, {"reward_mean": 0.5})
    assert "by source" not in write_report(plain).read_text()


def test_prometheus_gauges_carry_the_source_label(tmp_path):
    from prometheus_client import generate_latest

    from rlpost.observe import Recorder

    groups = [_group("arith", [1.0, 0.0], [2, 4]), _group("legs", [1.0, 1.0], [5, 5])]
    with Recorder(tmp_path) as rec:
        rec.record(1, source_metrics(groups))
        text = generate_latest(rec.registry).decode()
    assert 'rl_source_reward_mean{source="arith"} 0.5' in text
    assert 'rl_source_zero_spread_frac{source="legs"} 1.0' in text
    assert 'rl_source_response_length_mean{source="arith"} 3.0' in text
    assert "rl_source_prompts" not in text  # jsonl only
    row = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert '"source/legs/accuracy": 1.0' in row


def test_every_source_gauge_is_documented():
    from pathlib import Path

    from rlpost.observe.metrics import SOURCE_METRICS

    doc = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    for spec in SOURCE_METRICS:
        assert f"| `{spec.name}{{source}}` | gauge |" in doc, spec.name
