"""data.sources: loading, the weighted sampler, reward routing and the config rules."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlpost.config import (
    ArithConfig,
    FileTaskConfig,
    RewardConfig,
    RewardTerm,
    SourceConfig,
    load_config,
)
from rlpost.data.files import DataError
from rlpost.data.sampler import PromptSampler
from rlpost.data.sources import MixtureSampler, load_source, make_sampler
from rlpost.pipeline import build, rules
from rlpost.rewards.routing import RoutedScorer, build_routed_scorer
from rlpost.types import Prompt, RewardSample


def _prompts(source: str, n: int) -> list[Prompt]:
    return [Prompt(f"{source}{i}", i, uid=str(i), source=source) for i in range(n)]


def _mixture(seed: int = 0) -> MixtureSampler:
    rows = {"a": _prompts("a", 7), "b": _prompts("b", 3), "c": _prompts("c", 5)}
    return MixtureSampler(rows, {"a": 2.0, "b": 1.0, "c": 1.0}, batch_size=8, seed=seed)


def test_mixture_draws_by_weight_and_is_seeded():
    s = _mixture()
    drawn = Counter(p.source for _ in range(500) for p in s.next_batch())
    total = sum(drawn.values())
    # 4000 draws: each share within a few standard errors (~0.008) of 1/2, 1/4, 1/4
    assert abs(drawn["a"] / total - 0.5) < 0.04
    assert abs(drawn["b"] / total - 0.25) < 0.04 and abs(drawn["c"] / total - 0.25) < 0.04
    first = [p.text for p in _mixture().next_batch()]
    assert first == [p.text for p in _mixture().next_batch()]
    assert first != [p.text for p in _mixture(seed=1).next_batch()]


def test_mixture_walks_each_source_as_an_epoch():
    s = _mixture()
    drawn = [p for _ in range(40) for p in s.next_batch()]
    b = [p.text for p in drawn if p.source == "b"]
    # every consecutive run of 3 draws from source b is one permutation of its 3 rows
    for lo in range(0, len(b) - len(b) % 3, 3):
        assert sorted(b[lo : lo + 3]) == ["b0", "b1", "b2"]


def test_mixture_resumes_exactly():
    full = _mixture()
    expected = [[p.text for p in full.next_batch()] for _ in range(12)]
    part = _mixture()
    for _ in range(5):
        part.next_batch()
    state = json.loads(json.dumps(part.state_dict()))  # as a checkpoint keeps it
    resumed = _mixture()
    resumed.load_state_dict(state)
    assert [[p.text for p in resumed.next_batch()] for _ in range(7)] == expected[5:]


def test_mixture_refuses_another_runs_state_and_empty_sources():
    with pytest.raises(DataError, match=r"other data\.sources"):
        _mixture().load_state_dict({"epoch": 0, "index": 3})
    with pytest.raises(DataError, match=r"data.sources\[b\] has no training rows"):
        MixtureSampler({"a": _prompts("a", 2)}, {"a": 1.0, "b": 1.0}, 4)


def test_one_source_keeps_the_plain_sampler():
    rows = _prompts("", 9)
    s = make_sampler(rows, [], 4, seed=3)
    assert isinstance(s, PromptSampler)
    assert [p.text for p in s.next_batch()] == [
        p.text for p in PromptSampler(rows, 4, seed=3).next_batch()
    ]


def test_sources_load_tagged_with_prefixed_uids(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"q": f"w{i}", "a": i}) + "\n" for i in range(4)))
    task = FileTaskConfig(train_path=str(f), prompt_field="q", answer_field="a")
    src = SourceConfig(name="words", task=task, prompt_template="Say {prompt}")
    got = load_source(src, on_bad_row="error")
    both = sorted(p.text for p in got.train + got.held_out)
    assert both == ["Say w0", "Say w1", "Say w2", "Say w3"] and len(got.held_out) == 1
    assert {p.source for p in got.train} == {"words"} and got.train[0].uid.startswith("words/")
    assert got.train_report.rows == 4
    arith = load_source(SourceConfig(name="ar", task=ArithConfig()), on_bad_row="error")
    assert len(arith.train) == arith.train_report.rows and arith.held_out[0].uid.startswith("ar/")


def test_a_save_to_disk_directory_is_a_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"prompt": ["1+1=", "2+2=", ""], "answer": [2, 4, 0]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    src = SourceConfig(name="d", task=FileTaskConfig(train_path=str(tmp_path / "ds")))
    with pytest.raises(DataError, match=r"ds:3: field 'prompt' is missing or not a non-empty"):
        load_source(src, on_bad_row="error")
    got = load_source(src, on_bad_row="skip")
    assert sorted(p.answer for p in got.train + got.held_out) == [2, 4]
    assert got.train_report.skipped == 1
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(DataError, match=r"holds splits \['train'\]; name one split"):
        task = FileTaskConfig(train_path=str(tmp_path / "dd"))
        load_source(SourceConfig(name="d", task=task), on_bad_row="skip")


def test_rewards_are_routed_by_source():
    sources = [
        SourceConfig(name="words", reward=[RewardTerm(name="exact_match")]),
        SourceConfig(name="math"),
    ]
    scorer = build_routed_scorer(RewardConfig(), sources)
    assert isinstance(scorer, RoutedScorer)
    samples = [
        RewardSample("p", "12", answer=12, source="math"),  # numeric_match: 1
        RewardSample("p", "the answer is 12", answer="12", source="words"),  # exact: 0
        RewardSample("p", "ab", answer="ab", source="words"),  # exact: 1
        RewardSample("p", "x 7", answer=7, source="math"),  # numeric_match: 1
    ]
    got = scorer.score(samples)
    assert got.scores == [1.0, 0.0, 1.0, 1.0]
    nm, em = got.components["numeric_match"], got.components["exact_match"]
    assert nm[0] == 1.0 and nm[3] == 1.0 and nm[1] != nm[1] and nm[2] != nm[2]  # nan elsewhere
    assert em[1] == 0.0 and em[2] == 1.0 and em[0] != em[0]
    assert {t.name for t in scorer.terms} == {"numeric_match", "exact_match"}
    assert "words:exact_match/invalid" in scorer.counters()
    assert not isinstance(build_routed_scorer(RewardConfig(), sources[1:]), RoutedScorer)


@pytest.mark.parametrize(
    "sources, extra, expected",
    [
        ('[{name: a, task: arith}, {name: a, task: code}]', [],
         "data.sources name=a: two share the name"),
        ('[{name: a, task: arith}]', ["data.task=code"], "data.task=code: data.sources replaces"),
        ('[{name: a}]', [], "data.sources[a].task.train_path=None: a file source needs it"),
        ('[{name: a, task: arith, prompt_template: "{level} {prompt}"}]', [],
         "data.sources[a].prompt_template={level} {prompt}: names 'level'; task=arith"),
        ('[{name: a, task: arith, reward: [{name: nope}]}]', [],
         "data.sources[a].reward: unknown reward 'nope'"),
        ('[{name: a, task: arith, reward: []}]', [], "data.sources[a].reward=[]: no term"),
    ],
)  # fmt: skip
def test_bad_source_configs_are_refused_in_one_line(sources, extra, expected):
    cfg = load_config(None, [f"data.sources={sources}", *extra])
    found = rules.problems(cfg, "train")
    assert found and found[0].startswith(expected), found


def test_a_mixture_loads_per_source_with_its_system_prompt(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"w{i}", "answer": "x"}) + "\n" for i in range(3)))
    sources = (
        "[{name: ar, task: {name: arith, max_operand: 3, eval_size: 4}},"
        f' {{name: w, task: {{name: file, train_path: "{f}", eval_path: "{f}"}}, system_prompt: SYS}}]'
    )
    cfg = load_config(None, [f"data.sources={sources}", "data.chat_template=none"])
    train, held_out, reports = build.load_data(cfg)
    assert Counter(p.source for p in train) == {"ar": 28, "w": 3}
    assert Counter(p.source for p in held_out) == {"ar": 4, "w": 3}
    assert all(p.text.startswith("SYS\n\n") == (p.source == "w") for p in train + held_out)
    assert reports["train"].rows == 31 and reports["train"].sources["w"].rows == 3
    assert reports["eval"].sources["ar"].rows == 4


def test_a_file_without_eval_path_holds_out_its_eval_fraction(tmp_path, caplog):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(40)))
    src = SourceConfig(name="f", task=FileTaskConfig(train_path=str(f), eval_fraction=0.25))
    got = load_source(src, on_bad_row="error")
    assert len(got.held_out) == 10 and len(got.train) == 30
    assert not {p.uid for p in got.train} & {p.uid for p in got.held_out}
    again = load_source(src, on_bad_row="error")  # seeded: the same rows every load
    assert [p.uid for p in again.held_out] == [p.uid for p in got.held_out]
    f.write_text(json.dumps({"prompt": "only", "answer": 1}) + "\n")
    with caplog.at_level("WARNING"):
        one = load_source(src, on_bad_row="error")
    assert one.held_out == [] and "no row is held out" in caplog.text
