"""Every kind of bad row is named with file, line and reason, and counted by reason (CPU)."""

from __future__ import annotations

import json

import pytest

from rlpost.data import DataError, LoadReport, load_prompt_file
from rlpost.data.files import MAX_LINE_BYTES
from rlpost.data.render import prepare_prompts, render_prompt
from rlpost.models.tiny import build_char_tokenizer
from rlpost.types import Prompt

GOOD = {"question": "1+1=", "answer": "2", "level": 1}
BAD_ROWS = {  # reason -> raw JSONL line
    "not_utf8": b'{"question": "caf\xe9", "answer": "1"}',
    "invalid_json": b"{broken",
    "not_object": b"[1, 2]",
    "too_deep": b'{"question": "1+1=", "answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "line_too_long": b'{"question": "' + b"x" * MAX_LINE_BYTES + b'", "answer": "1"}',
    "empty_prompt": json.dumps({"question": "  ", "answer": "3"}).encode(),
    "missing_answer": json.dumps({"question": "2+2="}).encode(),
    "empty_answer": json.dumps({"question": "2+2=", "answer": ""}).encode(),
}


def _write(path, lines):
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_every_bad_row_refused_with_file_and_line(tmp_path):
    for number, (reason, raw) in enumerate(BAD_ROWS.items(), start=1):
        f = tmp_path / f"{reason}.jsonl"
        _write(f, [json.dumps(GOOD).encode(), raw])
        with pytest.raises(DataError, match=rf"{reason}.jsonl:2: ") as err:
            load_prompt_file(f, prompt_field="question")
        assert "\n" not in str(err.value), number


def test_skipped_rows_are_counted_by_reason(tmp_path):
    f = tmp_path / "d.jsonl"
    _write(f, [json.dumps(GOOD).encode(), *BAD_ROWS.values(), b"", json.dumps(GOOD).encode()])
    prompts, report = load_prompt_file(f, prompt_field="question", on_bad_row="skip")
    assert len(prompts) == 2 and report.rows == 2
    assert dict(report.skipped_by_reason) == dict.fromkeys(BAD_ROWS, 1)
    assert report.problems[0].startswith(f"{f}:2: not UTF-8 (byte 0xe9")
    counts = report.counts("train")
    assert counts["train_skipped"] == len(BAD_ROWS) and counts["train_skipped_not_utf8"] == 1


def test_a_json_array_file_loads_its_rows_by_place(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([GOOD, {"question": "", "answer": "1"}, {**GOOD, "answer": "3"}]))
    prompts, report = load_prompt_file(f, prompt_field="question", on_bad_row="skip")
    assert [(p.uid, p.answer) for p in prompts] == [("d.json:1", "2"), ("d.json:3", "3")]
    assert report.problems[0].startswith(f"{f}:2: field 'question' is missing")
    f.write_text(json.dumps([GOOD])[:-1])
    with pytest.raises(DataError, match=r"d.json: not a readable JSON array \(Expecting"):
        load_prompt_file(f, prompt_field="question")


@pytest.mark.parametrize(
    ("second", "template", "says", "kept", "reason"),
    [
        (  # a field the row lacks
            {"question": "3+3=", "answer": 6},
            "Q: {prompt} (level {level})",
            "names field 'level'",
            "Q: 1+1= (level 1)",
            "template_field",
        ),
        (  # a format spec the row's value does not take: a row problem, not a traceback
            {"question": "2+2=", "answer": 4, "level": "x"},
            "Q: {prompt} L{level:d}",
            "cannot format this row",
            "Q: 1+1= L1",
            "template_error",
        ),
    ],
)
def test_a_template_a_row_cannot_fill_is_refused_or_skipped_by_line(
    tmp_path, second, template, says, kept, reason
):
    f = tmp_path / "d.jsonl"
    _write(f, [json.dumps(GOOD).encode(), json.dumps(second).encode()])
    with pytest.raises(DataError, match=rf"d.jsonl:2: data.prompt_template {says}"):
        load_prompt_file(f, prompt_field="question", template=template)
    prompts, report = load_prompt_file(
        f, prompt_field="question", template=template, on_bad_row="skip"
    )
    assert [p.text for p in prompts] == [kept]
    assert report.skipped_by_reason == {reason: 1}


def test_overlong_prompts_are_filtered_and_counted_never_truncated():
    tok = build_char_tokenizer()
    prompts = [Prompt("1+1=", 2, uid="d.jsonl:1"), Prompt("9" * 50, 1, uid="d.jsonl:2")]
    report = LoadReport(rows=2)
    kept = prepare_prompts(
        prompts, tok, max_prompt_tokens=20, budget_note="n", on_bad_row="skip", report=report
    )
    assert [p.text for p in kept] == ["1+1="]
    assert report.rows == 1 and report.skipped_by_reason == {"prompt_too_long": 1}
    assert report.problems == ["d.jsonl:2: prompt is 50 tokens; n [prompt_too_long]"]
    with pytest.raises(DataError, match=r"d.jsonl:2: prompt is 50 tokens"):
        prepare_prompts(
            prompts,
            tok,
            max_prompt_tokens=20,
            budget_note="n",
            on_bad_row="error",
            report=LoadReport(),
        )


def test_chat_template_and_system_prompt():
    tok = build_char_tokenizer()
    assert render_prompt("1+1=", tok) == "1+1="  # no template: plain text
    assert render_prompt("1+1=", tok, system_prompt="Be brief.") == "Be brief.\n\n1+1="
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert render_prompt("1+1=", tok, system_prompt="S") == "<system>S\n<user>1+1=\n<assistant>"
    assert render_prompt("1+1=", tok, chat_template="none") == "1+1="


def test_a_template_that_reaches_into_a_value_is_refused_at_load(tmp_path):
    from rlpost.config import ConfigError, load_config
    from rlpost.pipeline.rules import check

    for bad in ("{prompt.upper}", "{level[0]}"):
        with pytest.raises(ConfigError, match="reaches into a value"):
            over = [f"run.output_dir={tmp_path}", "data.task=file", f"data.prompt_template={bad}"]
            check(load_config(None, [*over, "data.task.train_path=t.jsonl"]))
