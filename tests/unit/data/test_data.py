import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpost.data import DataError, PromptSampler, arith_splits, load_prompt_file


def test_arith_split_is_fixed_and_disjoint():
    train_a, held_a = arith_splits(30, ["+", "-"], 10_000, 500)
    _train_b, held_b = arith_splits(30, ["+", "-"], 10_000, 500)
    assert [p.text for p in held_a] == [p.text for p in held_b]
    assert len(held_a) == 500
    assert not {p.text for p in train_a} & {p.text for p in held_a}
    for p in held_a[:50]:
        _a, _rest = p.text.rstrip("=").replace("-", " - ").replace("+", " + ").split(" ", 1)
        assert eval(p.text.rstrip("=")) == p.answer


def test_arith_split_too_small_is_refused():
    with pytest.raises(ValueError, match="eval_size"):
        arith_splits(3, ["+"], 100, 500)


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_jsonl_bad_rows_error_with_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    _write_jsonl(f, [{"prompt": "1+1=", "answer": 2}, "{broken", {"prompt": "2+2=", "answer": 4}])
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        load_prompt_file(f)


def test_jsonl_bad_rows_skipped_and_counted(tmp_path):
    f = tmp_path / "d.jsonl"
    _write_jsonl(
        f,
        [
            {"prompt": "1+1=", "answer": 2, "level": 1},
            "{broken",
            {"prompt": "", "answer": 1},
            {"prompt": "x"},
            [1, 2],
            {"q": "3+3=", "a": 6},
        ],
    )
    prompts, report = load_prompt_file(f, on_bad_row="skip")
    assert [p.text for p in prompts] == ["1+1="]
    assert prompts[0].metadata == {"level": 1}
    assert report.skipped == 5 and report.rows == 1


def test_custom_fields_and_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["3+3=", "4+4="], "a": [6, 8]}), f)
    prompts, _report = load_prompt_file(
        f, prompt_field="q", answer_field="a", template="Q: {prompt}"
    )
    assert [p.text for p in prompts] == ["Q: 3+3=", "Q: 4+4="]
    assert [p.answer for p in prompts] == [6, 8]


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_file(tmp_path / "nope.jsonl")
    f = tmp_path / "d.csv"
    f.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported"):
        load_prompt_file(f)


def test_sampler_resumes_exactly():
    items = list(range(10))
    a = PromptSampler(items, 4, seed=3)
    first = [a.next_batch() for _ in range(2)]
    state = a.state_dict()
    rest_a = [a.next_batch() for _ in range(4)]
    b = PromptSampler(items, 4, seed=3)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(4)] == rest_a
    seen = sorted(x for batch in first for x in batch)
    assert len(seen) == 8 and len(set(seen)) == 8  # no repeats within an epoch
