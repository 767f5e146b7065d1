"""The reasoning_gym reward runs the scorers that evaluate answers in the real sandbox.

A hostile answer to such a task (``string_insertion`` evals it, ``countdown`` sympy-parses
it) must leave no trace on the host, and one that kills or wedges its run must cost
only its own score: the batch's other answers still score as they should.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("reasoning_gym")

from rlpost.config import ReasoningGymConfig
from rlpost.data.reasoning_gym import generate_splits
from rlpost.rewards.reasoning_gym import ReasoningGymScorer
from rlpost.rewards.reasoning_gym_sandbox import sandbox_problem
from rlpost.types import RewardSample

pytestmark = pytest.mark.sandbox


@pytest.fixture(autouse=True, scope="module")
def _sandbox_available() -> None:
    problem = sandbox_problem()
    if problem is not None:
        # CI sets RLPOST_REQUIRE_SANDBOX=1 so a broken sandbox fails instead of skipping.
        if os.environ.get("RLPOST_REQUIRE_SANDBOX") == "1":
            pytest.fail(problem)
        pytest.skip(problem)


def _prompt(task: str):
    return generate_splits(ReasoningGymConfig(task=task, train_size=1, eval_size=1), "{prompt}")[0][
        0
    ]


def _sample(prompt, answer: str) -> RewardSample:
    return RewardSample(prompt.text, f"<answer>{answer}</answer>", prompt.answer, prompt.metadata)


def test_an_answer_a_scorer_evaluates_leaves_no_trace_here(tmp_path):
    samples, marks = [], []
    for task in ("string_insertion", "countdown"):
        p = _prompt(task)
        mark = tmp_path / f"{task}.id"
        hostile = (
            f"__import__('os').system('id > {mark}') or __import__('os').environ."
            f"__setitem__('RLPOST_HOSTILE', '1') or 'x'"
        )
        samples += [_sample(p, p.answer), _sample(p, hostile)]
        marks.append(mark)
    scorer = ReasoningGymScorer()
    got = scorer.score(samples)
    assert got[0] == got[2] == 1.0 and got[1] == 0.0 and 0.0 <= got[3] < 1.0
    assert [m.exists() for m in marks] == [False, False] and "RLPOST_HOSTILE" not in os.environ
    assert scorer.counters()["sandboxed"] == 4


def test_an_answer_that_kills_or_wedges_its_run_costs_only_its_own_score():
    p = _prompt("string_insertion")
    kill = "__import__('os').kill(__import__('os').getppid(), 9)"
    wedge = "__import__('time').sleep(600)"
    answers = [p.answer, kill, p.answer, wedge, p.answer]
    scorer = ReasoningGymScorer(timeout_s=2)
    assert scorer.score([_sample(p, a) for a in answers]) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert scorer.counters()["scorer_errors"] == 2
