"""Contract: every reasoning-gym task generates a row and scores it through rlpost's reward:
its gold answer scores 1 and an empty answer 0, after the entry went through pickling (as to
a worker or a checkpoint). The tasks that cannot are listed with the reason."""

from __future__ import annotations

import pickle

import pytest

rg = pytest.importorskip("reasoning_gym")

from reasoning_gym.factory import DATASETS  # noqa: E402

from rlpost.config import ReasoningGymConfig  # noqa: E402
from rlpost.data.reasoning_gym import BROKEN, TaskEntry, task_problem  # noqa: E402
from rlpost.rewards.reasoning_gym import ReasoningGymScorer  # noqa: E402
from rlpost.types import RewardSample  # noqa: E402

SCORES_THE_SOLUTION = {
    # no gold answer in the row: the scorer checks the reply against the puzzle itself
    "boxnet": "plans moves; the scorer simulates them",
    "graph_color": "colours a graph; the scorer checks every edge",
    "propositional_logic": "derives a conclusion; the scorer checks it is valid",
    "rubiks_cube": "a move sequence; the scorer applies it to the cube",
    "rush_hour": "a move sequence; the scorer plays it",
}


def _score(scorer, task: str, entry: dict, reply: str) -> float | None:
    meta = {"reasoning_gym": TaskEntry(task, {}, entry, evaluate_answers=True)}
    return scorer.score([RewardSample("q", reply, entry.get("answer"), meta)])[0]


@pytest.mark.slow
def test_every_task_scores_gold_one_and_empty_zero():
    scorer = ReasoningGymScorer()
    wrong = {}
    for task in sorted(set(DATASETS) - set(BROKEN)):
        entry = pickle.loads(pickle.dumps(rg.create_dataset(task, seed=0, size=1)[0]))
        empty = _score(scorer, task, entry, "<answer></answer>")
        if task in SCORES_THE_SOLUTION:
            assert entry.get("answer") is None and empty == 0.0, task
            continue
        gold = _score(scorer, task, entry, f"<answer>{entry['answer']}</answer>")
        if (gold, empty) != (1.0, 0.0):
            wrong[task] = (gold, empty)
    assert wrong == {}
    assert scorer.counters()["scorer_errors"] == 0


def test_broken_tasks_are_refused_and_still_broken():
    for task, why in BROKEN.items():
        assert task_problem(ReasoningGymConfig(task=task)) == f"refused: {why}"
    # the reason stands: any non-empty answer scores 1.0 (drop the entry when this fails)
    ds = rg.create_dataset("game_of_life_halting", seed=0, size=1)
    assert ds.score_answer("not an answer", ds[0]) == 1.0
