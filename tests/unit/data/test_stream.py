"""Streamed file sources: lazy reads, buffer shuffle, bad rows as met, exact resume."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from rlpost.config import load_config
from rlpost.data import DataError
from rlpost.data.files import MAX_LINE_BYTES
from rlpost.data.stream import PREFLIGHT_ROWS, StreamSampler, preflight
from rlpost.pipeline import rules


def _keep(prompts, report):
    return prompts


def _write(path, n, bad=()):
    lines = []
    for i in range(1, n + 1):
        lines.append("{not json" if i in bad else json.dumps({"prompt": f"q{i}", "answer": str(i)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _sampler(path, **kw):
    args = dict(name="s", fit=_keep, buffer=8, seed=3, on_bad_row="skip") | kw
    return StreamSampler(str(path), **args)


def _draw(s, k):
    return [s.next_batch()[0].uid for _ in range(k)]


def test_each_epoch_is_a_shuffled_pass_over_every_row(tmp_path):
    f = _write(tmp_path / "d.jsonl", 50)
    s = _sampler(f)
    first, second = _draw(s, 50), _draw(s, 50)
    rows = {f"s/d.jsonl:{i}" for i in range(1, 51)}
    assert set(first) == rows and set(second) == rows and len(set(first)) == 50
    assert first != sorted(first, key=lambda u: int(u.split(":")[1]))  # shuffled
    assert first != second and s.epoch == 1  # the epoch seeds the buffer
    assert _draw(_sampler(f, buffer=1), 5) == [f"s/d.jsonl:{i}" for i in range(1, 6)]
    assert _draw(_sampler(f), 50) == first  # deterministic


@pytest.mark.parametrize("cut", [0, 7, 49, 50, 73])
def test_a_resume_draws_exactly_the_uninterrupted_rows(tmp_path, cut):
    f = _write(tmp_path / "d.jsonl", 50, bad={4, 30})
    whole = _draw(_sampler(f), 130)
    a = _sampler(f)
    head = _draw(a, cut)
    state = a.state_dict()
    b = _sampler(f)
    b.load_state_dict(state)
    assert head + _draw(b, 130 - cut) == whole
    assert b.report.problems == _sampler_report_after(f, 130)


def _sampler_report_after(f, k):
    s = _sampler(f)
    _draw(s, k)
    return s.report.problems


def test_bad_rows_are_counted_once_with_file_and_line(tmp_path):
    f = _write(tmp_path / "d.jsonl", 40, bad={5, 33})
    s = _sampler(f, buffer=4)
    _draw(s, 2)  # the buffer (4 rows) and a chunk were read: line 5 met, 33 too (one chunk)
    assert s.report.skipped_by_reason["invalid_json"] == 2
    _draw(s, 38 * 2)  # two more passes meet the same rows: not counted again
    assert s.report.rows == 38 and s.report.skipped == 2
    assert s.report.problems[0].startswith(f"{f}:5: not valid JSON")
    with pytest.raises(DataError, match=r"d.jsonl:5: not valid JSON"):
        _draw(_sampler(f, on_bad_row="error"), 1)


def test_rows_are_read_lazily_a_chunk_at_a_time(tmp_path):
    f = _write(tmp_path / "d.jsonl", PREFLIGHT_ROWS * 4)
    s = _sampler(f, buffer=10)
    _draw(s, 3)
    assert s.report.rows == PREFLIGHT_ROWS  # one chunk read, not the file


def test_an_over_long_line_is_a_bad_row_read_past_in_bounded_memory(tmp_path):
    f = tmp_path / "d.jsonl"
    huge = 16 * MAX_LINE_BYTES
    with f.open("wb") as out:
        out.write(b'{"prompt": "q1", "answer": "1"}\n{"prompt": "')
        for _ in range(huge // MAX_LINE_BYTES):
            out.write(b"x" * MAX_LINE_BYTES)
        out.write(b'", "answer": "2"}\n{"prompt": "q3", "answer": "3"}\n')
    s = _sampler(f)
    tracemalloc.start()
    try:
        got = _draw(s, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(got) == ["s/d.jsonl:1", "s/d.jsonl:3"]  # reading went on after line 2
    assert peak < 3 * MAX_LINE_BYTES  # the 16 MiB line was never held
    assert s.report.skipped_by_reason["line_too_long"] == 1
    assert s.report.problems == [
        f"{f}:2: line is {huge + 29:,} bytes; a row holds at most {MAX_LINE_BYTES:,} "
        "[line_too_long]"
    ]
    with pytest.raises(DataError, match=r"d.jsonl:2: line is .* bytes; .*on_bad_row=skip"):
        _draw(_sampler(f, on_bad_row="error"), 2)


def test_a_json_array_is_refused_in_one_line_and_json_lines_stream(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(1, 4)]
    array = tmp_path / "a.json"
    array.write_text("\n  " + json.dumps(rows, indent=2))
    with pytest.raises(DataError, match=r"a.json: holds one JSON array") as err:
        _sampler(array)
    assert "\n" not in str(err.value) and "jq -c '.[]' a.json > a.jsonl" in str(err.value)
    lines = _write(tmp_path / "l.json", 3)  # datasets' to_json writes JSON Lines as .json
    assert sorted(_draw(_sampler(lines), 3)) == [f"s/l.json:{i}" for i in (1, 2, 3)]


def test_parquet_streams_by_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(30)] + [
        {"prompt": "", "answer": "x"}
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    s = _sampler(path)
    got = _draw(s, 30)
    assert sorted(got) == sorted(f"s/d.parquet:{i}" for i in range(1, 31))
    assert s.report.skipped_by_reason["empty_prompt"] == 1
    assert s.report.problems[0].startswith(f"{path}:31:")


def test_preflight_checks_the_first_rows_only(tmp_path):
    args = dict(name="s", on_bad_row="skip")
    bad_head = _write(
        tmp_path / "b.jsonl", PREFLIGHT_ROWS + 5, bad=set(range(1, PREFLIGHT_ROWS + 1))
    )
    with pytest.raises(DataError, match=f"no usable row in the first {PREFLIGHT_ROWS} rows"):
        preflight({**args, "path": str(bad_head)}, _keep)
    late = _write(tmp_path / "l.jsonl", PREFLIGHT_ROWS + 5, bad={PREFLIGHT_ROWS + 2})
    head = preflight({**args, "path": str(late), "on_bad_row": "error"}, _keep)  # 258 not read
    assert [p.uid for p in head] == [f"s/l.jsonl:{i}" for i in range(1, PREFLIGHT_ROWS + 1)]
    with pytest.raises(DataError, match=r"stream reads \.jsonl or \.parquet"):
        preflight({**args, "path": str(tmp_path)}, _keep)


STREAM = {"name": "file", "train_path": "t.jsonl", "stream": True}


@pytest.mark.parametrize(
    "src, expected",
    [
        (f"data.sources={json.dumps([{'name': 'big', 'task': STREAM}])}", "data.sources[big]"),
        (f"data.task={json.dumps({**STREAM, 'eval_path': 'e.jsonl'})}", "data"),
    ],
)
def test_a_streamed_source_names_its_held_out_file(src, expected):
    found = rules.problems(load_config(None, [src]), "train")
    assert found and found[0].startswith(f"{expected}.task.stream=true: ")
    task = {**STREAM, "eval_path": "e.jsonl"}
    ok = json.dumps([{"name": "big", "task": task}])
    assert not [
        p
        for p in rules.problems(load_config(None, [f"data.sources={ok}"]), "train")
        if "stream" in p
    ]
