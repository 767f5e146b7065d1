"""Conversation rows: the assistant-only mask, history-rewriting templates, bad rows (CPU)."""

from __future__ import annotations

import json

import pytest

from rlpost.data.conversations import (
    Conversation,
    chat_arith,
    encode_conversation,
    encode_conversations,
    ensure_chat_template,
    load_conversation_file,
)
from rlpost.data.files import DataError, LoadReport
from rlpost.models.tiny import build_char_tokenizer

EOS = "</s>"


@pytest.fixture
def tok():
    t = build_char_tokenizer()
    assert ensure_chat_template(t)
    return t


def trained_text(tok, example) -> str:
    """The tokens the loss sees, decoded (special tokens kept)."""
    ids = [i for i, m in zip(example.token_ids, example.loss_mask, strict=True) if m]
    return tok.decode(ids)


def test_mask_is_every_assistant_turn_and_nothing_else(tok):
    conv = chat_arith(4)[1]  # user, assistant tool call, tool, assistant, user, assistant
    roles = [m["role"] for m in conv.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    (ex,), segmented = encode_conversation(conv, tok, max_len=512)
    assert not segmented
    call = conv.messages[1]["tool_calls"][0]["function"]
    replies = [
        f"<call>{call['name']}:{call['arguments']}</call>",
        *(m["content"] for m in conv.messages[3::2]),
    ]
    assert trained_text(tok, ex) == "".join(r + EOS for r in replies)
    assert ex.loss_mask[0] == 1  # the prompt ends where the first reply starts
    # The template's own {% generation %} marks give the same mask.
    marked = tok.apply_chat_template(
        conv.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert marked["input_ids"] == ex.prompt_ids + ex.token_ids
    assert marked["assistant_masks"] == [0] * len(ex.prompt_ids) + ex.loss_mask
    # Nothing the user, the tool or the system said is trained.
    untrained = tok.decode([i for i, m in zip(ex.token_ids, ex.loss_mask, strict=True) if not m])
    assert "<|tool|>" in untrained and conv.messages[4]["content"] in untrained


def test_system_turns_and_the_prompt_are_never_trained(tok):
    conv = chat_arith(1)[0]
    assert conv.messages[0]["role"] == "system"
    (ex,), _ = encode_conversation(conv, tok, max_len=512)
    head = tok.decode(ex.prompt_ids)
    assert head.startswith("<|system|>") and head.endswith("<|assistant|>\n")
    assert "Answer" not in trained_text(tok, ex)


def test_last_turn_only_trains_the_last_reply(tok):
    conv = chat_arith(4)[1]
    (ex,), _ = encode_conversation(conv, tok, last_turn_only=True, max_len=512)
    assert trained_text(tok, ex) == conv.messages[-1]["content"] + EOS
    # the earlier replies are still in the context, just not trained
    assert "<call>" in tok.decode(ex.prompt_ids + ex.token_ids)


# A template that rewrites history: earlier assistant turns are shown as "[...]", the last
# in full (as templates that drop past reasoning do). The prefix property fails.
REWRITING = (
    "{%- for m in messages -%}{{ '<' + m['role'] + '>' }}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}[...]"
    "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)


def test_a_history_rewriting_template_is_cut_into_one_example_per_turn(tok):
    tok.chat_template = REWRITING
    msgs = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "+3?"},
        {"role": "assistant", "content": "5"},
    ]
    examples, segmented = encode_conversation(Conversation(msgs, uid="f:1"), tok, max_len=512)
    assert segmented and len(examples) == 2
    assert [trained_text(tok, e) for e in examples] == ["2" + EOS, "5" + EOS]
    # each example is what the model saw at that turn: history rewritten, its reply whole
    assert (
        tok.decode(examples[1].prompt_ids) == "<user>1+1?<assistant>[...]</s><user>+3?<assistant>"
    )
    (last,), _ = encode_conversation(
        Conversation(msgs, uid="f:1"), tok, last_turn_only=True, max_len=512
    )
    assert trained_text(tok, last) == "5" + EOS


def test_a_template_whose_generation_prompt_is_no_prefix_is_a_bad_row(tok):
    tok.chat_template = (
        "{%- for m in messages -%}{{ m['role'] + ':' + m['content'] + ';' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}ASSISTANT>{%- endif -%}"
    )
    conv = Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    reason, line = encode_conversation(conv, tok, max_len=512)
    assert reason == "template_prefix" and "turn 1" in line


def test_bad_rows_are_skipped_with_file_and_line(tmp_path, tok):
    good = chat_arith(2)
    rows = [
        {"messages": good[0].messages, "answer": 1},  # line 1: good
        {"messages": [{"role": "user", "content": "hi"}]},  # 2: no assistant turn
        {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]},
        {"messages": [{"role": "robot", "content": "x"}]},  # 4: unknown role
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "r"},
                {"role": "assistant", "content": "s"},
            ]
        },  # 5: tool after no call
        {"text": "no messages"},  # 6
        {"messages": good[1].messages},  # 7: good
        {
            "messages": [
                {"role": "user", "content": "q" * 600},
                {"role": "assistant", "content": "a"},
            ]
        },  # 8: over the context
    ]
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "{not json")  # becomes line 6, the 'no messages' row line 7 ...
    path.write_text("\n".join(lines) + "\n")
    convs, report = load_conversation_file(path, on_bad_row="skip")
    examples = encode_conversations(
        convs, tok, last_turn_only=False, max_len=256, on_bad_row="skip", report=report
    )
    assert len(examples) == 2 and report.rows == 2
    assert dict(report.skipped_by_reason) == {
        "no_assistant": 1,
        "roles_out_of_order": 2,
        "unknown_role": 1,
        "invalid_json": 1,
        "no_messages": 1,
        "too_long": 1,
    }
    where = {p.split(": ")[0]: p for p in report.problems}
    assert set(where) == {f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7, 9)}
    assert "comes before any user message" in where[f"{path}:3"]
    assert "follows no assistant turn" in where[f"{path}:5"]
    assert "robot" in where[f"{path}:4"] and "[too_long]" in where[f"{path}:9"]
    assert convs[0].answer == 1 and convs[1].answer is None


def test_a_bad_row_is_refused_in_one_line_by_default(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError) as err:
        load_conversation_file(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: ") and "no assistant turn" in msg and "\n" not in msg


def test_an_over_long_row_is_refused_with_its_line(tok):
    conv = Conversation(
        [{"role": "user", "content": "q" * 300}, {"role": "assistant", "content": "a"}],
        uid="c.jsonl:7",
    )
    with pytest.raises(DataError, match=r"^c\.jsonl:7: the conversation is \d+ tokens"):
        encode_conversations(
            [conv], tok, last_turn_only=False, max_len=128, on_bad_row="error", report=LoadReport()
        )


def test_a_long_conversation_is_too_long_after_one_rendering(tok):
    msgs = []
    for i in range(800):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    renders = []
    real = tok.apply_chat_template

    def counted(messages, **kw):
        renders.append(len(messages))
        return real(messages, **kw)

    tok.apply_chat_template = counted
    got = encode_conversation(Conversation(msgs, uid="c.jsonl:3"), tok, max_len=2048)
    assert got[0] == "too_long" and got[1].endswith("tokens; the context holds 2048")
    assert renders == [1600]  # not 2 * 800 + 1 renderings of its prefixes
    renders.clear()
    fits = encode_conversation(Conversation(msgs[:4], uid="c.jsonl:4"), tok, max_len=2048)
    assert len(fits[0]) == 1 and sorted(renders) == [1, 2, 3, 4]


def test_parquet_rows_load_like_jsonl(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    convs = chat_arith(6)
    table = pa.Table.from_pylist([{"messages": c.messages, "answer": c.answer} for c in convs])
    pq.write_table(table, tmp_path / "chats.parquet")
    got, report = load_conversation_file(tmp_path / "chats.parquet")
    assert report.rows == 6 and [c.answer for c in got] == [c.answer for c in convs]
    want = encode_conversations(
        convs, tok, last_turn_only=False, max_len=512, on_bad_row="error", report=LoadReport()
    )
    have = encode_conversations(
        got, tok, last_turn_only=False, max_len=512, on_bad_row="error", report=report
    )
    assert [e.token_ids for e in have] == [e.token_ids for e in want]
    assert [e.loss_mask for e in have] == [e.loss_mask for e in want]
