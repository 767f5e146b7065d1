"""What the reasoning_gym reward scores in this process is proven not to evaluate the answer.

The probe runs EVERY scorer of the installed reasoning-gym, here, on answers that set a
flag and write a file if anything evaluates them (a benign payload, shaped the ways
scorers read answers: bare, in a list, a tuple, a dict, an expression). Every task whose
scorer took the bait must be one the scan sends to the sandbox; so a new reasoning-gym
whose scorer starts evaluating answers fails here before it can score in-process. The
scan's own set is pinned too, so a change in it is reviewed.
"""

from __future__ import annotations

import builtins
import json
import re

import pytest

rg = pytest.importorskip("reasoning_gym")

from reasoning_gym.factory import DATASETS  # noqa: E402

from rlpost.data import load_prompt_file  # noqa: E402
from rlpost.data.files import DataError  # noqa: E402
from rlpost.data.reasoning_gym import BROKEN  # noqa: E402
from rlpost.rewards.reasoning_gym import ReasoningGymScorer  # noqa: E402
from rlpost.rewards.reasoning_gym_scan import evaluating_calls, task_evaluates  # noqa: E402
from rlpost.types import RewardSample  # noqa: E402

FLAG = "RLPOST_EVALUATED"

EVALUATING = {
    # the answer goes through eval / sympy's parse_expr
    "binary_matrix": "eval(answer)",
    "countdown": "sympy parse_expr(answer)",
    "intermediate_integration": "sympy parse_expr(answer)",
    "n_queens": "eval(answer)",
    "polynomial_multiplication": "sympy parse_expr(answer)",
    "puzzle24": "sympy parse_expr(answer)",
    "simple_integration": "sympy parse_expr(answer)",
    "spiral_matrix": "eval(answer)",
    "string_insertion": "eval(answer)",
    # the entry does: safe only while entries are rlpost's own (a file row cannot be one)
    "bitwise_arithmetic": "eval(entry's problem)",
    "number_sorting": "eval(entry's answer) when it is not JSON",
}


def _payloads(path) -> list[str]:
    effect = (
        f"__import__('builtins').__dict__.__setitem__('{FLAG}', 1) "
        f"or open({str(path)!r}, 'w').close()"
    )
    shapes = [
        "{}",
        "({}) or 'x'",
        "[{}]",
        "{}, 1",
        "1, {}",
        "[[{}]]",
        "{{'a': {}}}",
        "({} or 1) + 1",
    ]
    return [shape.format(effect) for shape in shapes]


def test_every_scorer_that_evaluates_a_hostile_answer_is_sent_to_the_sandbox(tmp_path):
    took_the_bait = {}
    for task in sorted(set(DATASETS) - {"composite"}):
        dataset = rg.create_dataset(task, seed=0, size=1)
        entry = dataset[0]
        for i, answer in enumerate(_payloads(tmp_path / f"{task}.evaluated")):
            try:
                dataset.score_answer(answer, entry)
            except Exception:  # a scorer raising on odd input is the reward's business
                pass
            if builtins.__dict__.pop(FLAG, None) or (tmp_path / f"{task}.evaluated").exists():
                took_the_bait.setdefault(task, i)
    assert took_the_bait, "the payload no longer reaches any scorer: the probe proves nothing"
    assert {t for t in took_the_bait if not task_evaluates(t)} == set()
    flagged = {t for t in DATASETS if t not in BROKEN and task_evaluates(t)}
    assert flagged == set(EVALUATING)


def _helper(text):
    return eval(text)


class _Base:
    def score_answer(self, answer, entry):
        return _helper(answer)


class _Child(_Base):
    def score_answer(self, answer, entry):
        return super().score_answer(answer, entry) if self._ok(answer) else 0.0

    def _ok(self, answer):
        return re.compile("x").match(answer) is not None


class _Plain:
    def score_answer(self, answer, entry):
        return float(re.compile(r"\d+").fullmatch(answer) is not None)


# the scan follows reasoning-gym's own code only: these stand in for it
_helper.__module__ = _Base.__module__ = _Child.__module__ = "reasoning_gym.fake"


def test_the_scan_follows_helpers_methods_and_super_but_not_regex_compile():
    assert evaluating_calls(_Child) == ("eval",)
    assert evaluating_calls(_Plain) == ()
    assert task_evaluates("countdown") == ("sympy.parse_expr",)
    assert task_evaluates("basic_arithmetic") == ()  # evaluates only in its generator


def test_a_file_row_cannot_choose_the_task_or_entry_a_scorer_evaluates(tmp_path):
    # number_sorting evaluates its entry's answer when that is not JSON
    entry = {"answer": f"__import__('builtins').__dict__.__setitem__('{FLAG}', 1)",
             "metadata": {"direction": "ascending"}}  # fmt: skip
    row = {"prompt": "sort", "answer": "x", "reasoning_gym": {"task": "number_sorting",
           "config": {}, "entry": entry}}  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl:1: column 'reasoning_gym' is reserved"):
        load_prompt_file(path)
    path.write_text(json.dumps(row) + "\n" + json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    prompts, report = load_prompt_file(path, on_bad_row="skip")
    assert report.skipped_by_reason == {"reserved_field": 1} and len(prompts) == 1
    # and a row that reached the reward another way (a stream, a plugin) is not applicable
    scorer = ReasoningGymScorer()
    got = scorer.score([RewardSample("sort", "<answer>[1, 2]</answer>", "x", row)])
    assert got == [None] and FLAG not in builtins.__dict__


def test_an_evaluating_task_is_refused_without_the_opt_in_or_where_the_sandbox_cannot_run(
    monkeypatch, tmp_path
):
    from rlpost.config import load_config
    from rlpost.data.reasoning_gym import TaskEntry
    from rlpost.pipeline import rules

    monkeypatch.setenv("PATH", str(tmp_path))  # no bubblewrap on it
    found = {}
    for task, opt_in in (("countdown", False), ("countdown", True), ("basic_arithmetic", False)):
        src = f"[{{name: g, task: {{name: reasoning_gym, task: {task}, evaluate_answers: {opt_in}}}}}]"
        found[task, opt_in] = rules.problems(load_config(None, [f"data.sources={src}"]), "train")
    assert found["basic_arithmetic", False] == []
    assert found["countdown", False] == [
        "data.sources[g].task.task=countdown: its scorer evaluates the answer as code "
        "(sympy.parse_expr); set evaluate_answers=true beside it to score it in the sandbox"
    ]
    assert found["countdown", True] == [
        "data.sources[g].task.task=countdown: its scorer evaluates the answer as code "
        "(sympy.parse_expr), which rlpost runs only in the sandbox, and the sandbox cannot run "
        "here: bubblewrap (bwrap) is not on PATH; install it with: apt-get install -y bubblewrap"
    ]
    # and an entry made without the opt-in is refused by the reward too, before any scoring
    entry = rg.create_dataset("countdown", seed=0, size=1)[0]
    sample = RewardSample(
        "q", "<answer>1</answer>", None, {"reasoning_gym": TaskEntry("countdown", {}, entry)}
    )
    with pytest.raises(ValueError, match=r"^task=countdown: .* set evaluate_answers=true"):
        ReasoningGymScorer().score([sample])


def test_an_answer_over_the_length_cap_scores_zero_unread():
    from rlpost.data.reasoning_gym import TaskEntry

    entry = rg.create_dataset("basic_arithmetic", seed=0, size=1)[0]
    meta = {"reasoning_gym": TaskEntry("basic_arithmetic", {}, entry)}
    cap = len(entry["answer"])
    scorer = ReasoningGymScorer(max_answer_chars=cap)
    long, gold = "1" * (cap + 1), f"<answer>{entry['answer']}</answer>"
    assert scorer.score([RewardSample("q", f"<answer>{long}</answer>", None, meta),
                         RewardSample("q", gold, None, meta)]) == [0.0, 1.0]  # fmt: skip
    assert scorer.counters()["too_long"] == 1
    with pytest.raises(ValueError, match="max_answer_chars=0 must be an integer >= 1"):
        ReasoningGymScorer(max_answer_chars=0)
