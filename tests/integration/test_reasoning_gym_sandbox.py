"""The reasoning_gym reward runs the scorers that evaluate answers in the real sandbox.

A hostile answer to such a task (``string_insertion`` evals it, ``countdown`` and
``puzzle24`` sympy-parse it) must leave no trace on the host, cannot choose its own score
by writing one where the scorer's reply goes, and one that tries to kill or wedges the
scoring costs only its own score, without a new sandbox.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("reasoning_gym")

from rlpost.config import ReasoningGymConfig
from rlpost.data.reasoning_gym import generate_splits
from rlpost.rewards.reasoning_gym import ReasoningGymScorer
from rlpost.rewards.reasoning_gym_sandbox import parse_scores, sandbox_problem
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
    c = ReasoningGymConfig(task=task, train_size=1, eval_size=1, evaluate_answers=True)
    return generate_splits(c, "{prompt}")[0][0]


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


def test_an_answer_cannot_report_its_own_score():
    # writes a score on every descriptor it holds, then exits before the scorer goes on
    forge = (
        "__import__('builtins').exec(\"import os\\nfor fd in range(3, 256):\\n try: "
        'os.write(fd, {score!r})\\n except OSError: pass\\nos._exit(0)")'
    )
    samples = []
    for task in ("string_insertion", "countdown", "puzzle24"):
        p = _prompt(task)
        samples += [_sample(p, forge.format(score=s)) for s in (b"1.0", b"10.0", b"1.0\n")]
    scorer = ReasoningGymScorer()
    # the evaluator relays the evaluation's reply, here garbage: unscored (0), or where the
    # text did not evaluate, the task's own score of a wrong answer (0.01 for two of them)
    got = scorer.score(samples)
    assert set(got) <= {0.0, 0.01} and got[:2] == [0.0, 0.0], got
    assert scorer.counters()["scorer_errors"] >= 6
    assert scorer.counters()["sandbox_restarts"] == 0


def test_a_score_outside_the_range_is_clipped():
    lines = "\n".join(f"n {i} {v}" for i, v in enumerate(["10.0", "-3", "0.25", "nan", "inf"]))
    scores, started = parse_scores(lines, "n", 5)
    assert [scores[i] for i in range(3)] == [1.0, 0.0, 0.25] and scores[4] == 1.0
    assert scores[3] != scores[3] and started == set()


def test_answers_that_kill_or_wedge_cost_only_their_own_score_and_no_restart():
    p = _prompt("string_insertion")
    kills = [
        "__import__('os').kill(__import__('os').getppid(), 9)",
        "__import__('os').kill(-1, 9)",
        "__import__('os').kill(1, 9)",
        "__import__('os').killpg(0, 9)",
    ] * 4
    wedge = "__import__('time').sleep(600)"
    answers = [p.answer, *kills, p.answer, wedge, p.answer]
    scorer = ReasoningGymScorer(timeout_s=2)
    assert scorer.score([_sample(p, a) for a in answers]) == [1.0, *[0.0] * 16, 1.0, 0.0, 1.0]
    # the kills are refused (no signal leaves the evaluation); the wedge is stopped
    assert scorer.counters()["scorer_errors"] == 1
    assert scorer.counters()["sandbox_restarts"] == 0
