"""The typed worker error and the one-line form of an error (CPU, no workers)."""

from __future__ import annotations

import pickle

import pytest

from rlpost.errors import KINDS, WorkerError, kind_of, one_line, typed_line


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_error_survives_pickling_with_its_role_and_kind(kind):
    err = WorkerError("rollout", kind, "rollout-1 worker, generate: why")
    for dumps, loads in [(pickle.dumps, pickle.loads), _cloudpickle()]:
        back = loads(dumps(err))
        assert type(back) is WorkerError
        assert (back.role, back.kind, back.message, str(back)) == (
            "rollout",
            kind,
            "rollout-1 worker, generate: why",
            "rollout-1 worker, generate: why",
        )


def _cloudpickle():
    """Ray moves a task's error with cloudpickle."""
    cloudpickle = pytest.importorskip("cloudpickle")
    return cloudpickle.dumps, cloudpickle.loads


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match="use one of behind, draining, lost"):
        WorkerError("trainer", "gone", "x")


def test_kind_of_reads_a_worker_error_and_calls_anything_else_failed():
    err = WorkerError("rollout", "behind", "holds weights version 0, was sent 3")
    assert kind_of(err) == "behind" and kind_of(RuntimeError("behind")) == "failed"


def test_one_line_is_the_first_non_blank_line_or_the_type():
    assert one_line(ValueError("\n  first  \nsecond")) == "first"
    assert one_line(KeyError()) == "KeyError"
    assert one_line("") == ""  # text has no type to fall back on
    assert one_line(RuntimeError("x" * 50), limit=10) == "xxxxxxx..."
    assert typed_line(ValueError("bad\nmore")) == "ValueError: bad"
    assert typed_line(OSError()) == "OSError"
    assert typed_line(WorkerError("reward", "failed", "reward worker, score: boom")) == (
        "reward worker, score: boom"
    )
