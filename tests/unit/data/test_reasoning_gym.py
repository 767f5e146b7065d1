"""reasoning-gym tasks as a source: generation, de-duplication, held-out split, the reward."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym")

from rlpost.config import ReasoningGymConfig, load_config
from rlpost.data.reasoning_gym import HASH_SEEDED, _draw_fixed_hash, generate_splits
from rlpost.pipeline import rules
from rlpost.rewards.reasoning_gym import ReasoningGymScorer, extract_answer
from rlpost.types import RewardSample

# 1-digit sums without sign or parentheses: at most 100 questions
TINY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}  # fmt: skip


def _splits(task: str, train: int, eval_: int, **config):
    c = ReasoningGymConfig(task=task, train_size=train, eval_size=eval_, config=config)
    return generate_splits(c, "Q: {prompt}")


def test_rows_are_unique_held_out_disjoint_and_fixed():
    train, held_out, info = _splits("basic_arithmetic", 40, 10)
    assert len(train) == 40 and len(held_out) == 10 and info["short"] == 0
    questions = [p.text for p in train + held_out]
    assert len(set(questions)) == 50 and questions[0].startswith("Q: ")
    again, again_held, _ = _splits("basic_arithmetic", 40, 10)
    assert [p.text for p in again] == [p.text for p in train]
    assert [p.uid for p in again_held] == [p.uid for p in held_out]
    entry = train[0].metadata["reasoning_gym"].entry
    assert train[0].answer == entry["answer"] and entry["question"] in train[0].text


def test_a_small_task_space_gives_what_it_has_and_says_so():
    train, held_out, info = _splits("basic_arithmetic", 500, 20, **TINY)
    assert info["unique"] == len(train) + 20 <= 200 and info["short"] == 520 - info["unique"]
    assert info["draws"] > info["unique"]
    assert not {p.text for p in train} & {p.text for p in held_out}
    with pytest.raises(ValueError, match=r"eval_size=500: task basic_arithmetic gave \d+ unique"):
        _splits("basic_arithmetic", 10, 500, **TINY)


@pytest.mark.slow  # three Python processes importing reasoning-gym
def test_hash_dependent_task_rows_match_in_another_process():
    task = "ransom_note"
    assert task in HASH_SEEDED
    here = [p.text for p in _splits(task, 4, 1)[0]]
    code = (
        "import pickle, sys; from tests.unit.data.test_reasoning_gym import _splits; "
        f"sys.stdout.buffer.write(pickle.dumps([p.text for p in _splits({task!r}, 4, 1)[0]]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True)
    assert pickle.loads(done.stdout) == here


@pytest.mark.slow  # a Python process importing reasoning-gym
def test_the_generator_child_ignores_modules_in_the_working_directory(tmp_path, monkeypatch):
    for name in ("random", "reasoning_gym", "pickle"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    args = ("ransom_note", {}, 0, 3, 50)
    entries, draws = _draw_fixed_hash(*args)
    assert len(entries) == 3 and draws >= 3 and "question" in entries[0][1]


def test_a_generator_child_that_hangs_is_stopped_with_its_task_named(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(3600)\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    with pytest.raises(ValueError) as err:
        _draw_fixed_hash("ransom_note", {}, 0, 3, 50, timeout=2)
    assert str(err.value) == (
        "task=ransom_note: generating 3 rows in a child process took over 2 s; "
        "lower train_size and eval_size or narrow its config"
    )


def test_tasks_without_an_answer_are_allowed():
    train, _, _ = _splits("rush_hour", 2, 1)
    assert train and all(p.answer is None for p in train)


@pytest.mark.parametrize(
    "task, extra, expected",
    [
        ("game_of_life_halting", "", "refused: its scorer gives 1.0 to any non-empty answer"),
        ("basic_arithmetc", "", "reasoning-gym has no task 'basic_arithmetc'; did you mean basic_arithmetic"),
        ("basic_arithmetic", ", config: {seed: 3}", "config.seed is set by the source"),
        ("basic_arithmetic", ", config: {min_terms: 9, max_terms: 2}", "task basic_arithmetic refuses"),
    ],
)  # fmt: skip
def test_bad_reasoning_gym_sources_are_refused_at_load(task, extra, expected):
    src = f"[{{name: rg, task: {{name: reasoning_gym, task: {task}{extra}}}}}]"
    found = rules.problems(load_config(None, [f"data.sources={src}"]), "train")
    assert found and found[0].startswith(f"data.sources[rg].task.task={task}: {expected}")


def _sample(prompt, completion: str) -> RewardSample:
    return RewardSample(prompt.text, completion, prompt.answer, prompt.metadata, source="rg")


def test_reward_scores_the_extracted_answer_with_the_tasks_scorer():
    p = _splits("basic_arithmetic", 3, 1)[0][0]
    gold = str(p.answer)
    scorer = ReasoningGymScorer()
    got = scorer.score(
        [
            _sample(p, f"thinking <answer> {gold} </answer>"),
            _sample(p, f"{gold}{gold}"),  # no tag: no answer (the raw scorer gives partial credit)
            _sample(p, "<answer></answer>"),
            RewardSample("1+1=", "2", 2),  # another source's prompt: not applicable
        ]
    )
    assert got == [1.0, 0.0, 0.0, None]
    assert scorer.counters() == {"scorer_errors": 0, "no_answer": 2, "too_long": 0,
                                 "sandboxed": 0, "too_large": 0, "timed_out": 0,
                                 "sandbox_restarts": 0}  # fmt: skip
    last_line = ReasoningGymScorer(extract="last_line")
    assert last_line.score([_sample(p, f"so\n{gold}\n\n")]) == [1.0]


def test_a_scorer_that_raises_scores_zero_and_is_counted():
    p = _splits("prime_factorization", 2, 1)[0][0]
    scorer = ReasoningGymScorer()
    assert scorer.score([_sample(p, "<answer>zzz</answer>")]) == [0.0]
    assert scorer.counters()["scorer_errors"] == 1
    assert scorer.score([_sample(p, f"<answer>{p.answer}</answer>")]) == [1.0]


def test_extraction_and_its_parameters():
    assert extract_answer("<answer>a</answer> <answer> b </answer>", "tag", "answer") == "b"
    assert extract_answer("x\n  y  \n", "last_line", "answer") == "y"
    assert extract_answer("   ", "whole", "answer") is None
    with pytest.raises(ValueError, match="extract='first' must be one of tag, last_line, whole"):
        ReasoningGymScorer(extract="first")
    src = "[{name: a, task: arith, reward: [{name: reasoning_gym, extract: first}]}]"
    found = rules.problems(load_config(None, [f"data.sources={src}"]), "train")
    assert found and "extract='first' must be one of" in found[0]


def test_generated_prompts_survive_a_state_file_and_still_score(tmp_path):
    from rlpost.statefile import load_state, save_state
    from rlpost.train import checkpoint  # noqa: F401  (allows rlpost's records in state files)

    train = _splits("basic_arithmetic", 2, 1)[0]
    save_state({"pending": [train]}, tmp_path / "state.pt")
    back = load_state(tmp_path / "state.pt")["pending"][0]
    assert back == train
    got = ReasoningGymScorer().score([_sample(p, f"<answer>{p.answer}</answer>") for p in back])
    assert got == [1.0, 1.0]
