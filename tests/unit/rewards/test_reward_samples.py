"""SampleWriter: RUN_DIR/samples/step_N.jsonl with every component, on schedule."""

import json
import math

import pytest

from rlpost.rewards.scorer import SampleWriter
from rlpost.types import RewardSample, ScoredBatch


def batch(n: int):
    samples = [
        RewardSample(f"p{i}", f"c{i} é", answer={"v": i}, finish_reason="length", num_tokens=i)
        for i in range(n)
    ]
    scored = ScoredBatch(
        scores=[float(i) for i in range(n)],
        components={"acc": [1.0] * n, "judge": [math.nan] * n},
    )
    return samples, scored


def test_writes_due_steps_only(tmp_path):
    writer = SampleWriter(tmp_path, every=5, count=2)
    samples, scored = batch(3)
    assert writer.maybe_write(3, samples, scored) is None
    path = writer.maybe_write(10, samples, scored)
    assert path == tmp_path / "samples" / "step_10.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 2
    assert rows[1] == {
        "prompt": "p1",
        "completion": "c1 é",
        "answer": {"v": 1},
        "score": 1.0,
        "components": {"acc": 1.0, "judge": None},
        "finish_reason": "length",
        "num_tokens": 1,
    }
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_10.jsonl"]


def test_never_writes_with_every_zero_and_checks_lengths(tmp_path):
    samples, scored = batch(2)
    assert SampleWriter(tmp_path, every=0, count=2).maybe_write(0, samples, scored) is None
    assert not (tmp_path / "samples").exists()
    with pytest.raises(ValueError, match="2 samples but 1 scores"):
        SampleWriter(tmp_path, every=1, count=2).maybe_write(1, samples, ScoredBatch([0.0]))
    with pytest.raises(ValueError, match="count"):
        SampleWriter(tmp_path, every=1, count=0)


def test_a_lone_surrogate_in_model_text_is_written_replaced(tmp_path):
    writer = SampleWriter(tmp_path, every=1, count=1)
    samples = [RewardSample("p", "a\ud800b", answer=1)]
    path = writer.maybe_write(1, samples, ScoredBatch(scores=[0.0], components={}))
    assert json.loads(path.read_text(encoding="utf-8"))["completion"] == "a?b"
