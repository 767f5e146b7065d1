"""Conversations for supervised fine-tuning: OpenAI-style ``messages`` rows, checked,
rendered with the tokenizer's chat template and masked to the assistant's tokens.

A row is bad (``data.on_bad_row``, :mod:`rlpost.data.files`) without an assistant turn, with
an unknown role or roles out of order, non-text content, or more tokens than the context.

The mask comes from rendering: assistant turn ``k``'s tokens are ``E_k[len(P_k):]``, ``P_k``
the rendering up to the turn with the generation prompt and ``E_k`` up to its end. When all
are prefixes of the whole rendering, the conversation is one example; a template that
rewrites history (Qwen3) gives one example per turn, ``E_k``; one where ``P_k`` is not a
prefix of ``E_k`` is skipped as ``template_prefix``.

A tokenizer without a chat template gets :data:`PLAIN_CHAT_TEMPLATE`, saved with the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpost.data.files import DataError, LoadReport, Problem, refuse_or_skip, unreadable, valid_rows
from rlpost.types import Completion

ROLES = ("system", "user", "assistant", "tool")

PLAIN_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{ '<|system|>\n# Tools\nYou may call these functions:\n<tools>\n' }}"
    "{%- for t in tools -%}{{ t | tojson }}{{ '\n' }}{%- endfor -%}"
    "{{ '</tools>' + ('\n' if messages else '') }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ ('' if loop.first else '\n') + '<|' + m['role'] + '|>\n' }}"
    "{%- if m['role'] == 'assistant' -%}{% generation %}"
    "{%- if m['content'] %}{{ m['content'] }}{% endif -%}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "{%- set a = c['function']['arguments'] -%}"
    "{{ '<call>' + c['function']['name'] + ':' + (a if a is string else a | tojson) + '</call>' }}"
    "{%- endfor -%}"
    "{{ eos_token }}{% endgeneration %}"
    "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ ('\n' if messages else '') + '<|assistant|>\n' }}"
    "{%- endif -%}"
)
"""``<|role|>`` then the content, messages a line apart; an assistant turn ends with EOS.
A request's ``tools`` open the chat as JSON inside ``<tools>`` (the Hermes layout)."""


@dataclass
class Conversation:
    """One checked row: its messages (up to the last assistant turn), its reference answer
    (None: the row has none) and ``uid`` as ``file:line``."""

    messages: list[dict[str, Any]]
    answer: Any = None
    uid: str = ""


def ensure_chat_template(tokenizer) -> bool:
    """Give ``tokenizer`` :data:`PLAIN_CHAT_TEMPLATE` when it has none; True if it was given."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return True


def check_messages(messages: Any) -> Problem | None:
    """The problem of a ``messages`` value, or None (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        return "no_messages", "messages is missing or not a non-empty list"
    prev = None
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "bad_message", f"message {i} is not an object with a role"
        role = m["role"]
        if role not in ROLES:
            return "unknown_role", f"message {i} has role {role!r}; roles are {', '.join(ROLES)}"
        content = m.get("content")
        calls = role == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(content, str) and not (calls and content is None):
            return "bad_content", f"message {i} ({role}) has no text content"
        order = _order_problem(role, prev)
        if order is not None:
            return "roles_out_of_order", f"message {i} ({role}) {order}"
        prev = role
    if "assistant" not in (m["role"] for m in messages):
        return "no_assistant", "the conversation has no assistant turn to train on"
    return None


def _order_problem(role: str, prev: str | None) -> str | None:
    if role == "system":
        return None if prev is None else "comes after the first message"
    if prev in (None, "system"):
        return None if role == "user" else "comes before any user message"
    if role == "tool" and prev not in ("assistant", "tool"):
        return "follows no assistant turn"
    if role == "assistant" and prev not in ("user", "tool"):
        return "follows another assistant turn"
    return None


def _check_row(row: Any, messages_field: str) -> Problem | None:
    problem = unreadable(row)
    if problem is not None:
        return problem
    if messages_field not in row:
        return "no_messages", f"field {messages_field!r} is missing"
    return check_messages(row[messages_field])


def load_conversation_file(
    path: str | Path,
    *,
    messages_field: str = "messages",
    answer_field: str = "answer",
    on_bad_row: str = "error",
) -> tuple[list[Conversation], LoadReport]:
    """Checked conversations of a JSONL or Parquet file; raises :class:`DataError`."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"conversation file {str(p)!r} does not exist")
    report = LoadReport()
    out = []
    check = lambda row: _check_row(row, messages_field)  # noqa: E731
    for line, row in valid_rows(p, check, on_bad_row, report):
        messages = row[messages_field]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append(Conversation(messages[: last + 1], row.get(answer_field), f"{p}:{line}"))
    if not out:
        raise DataError(f"conversation file {str(p)!r} has no usable rows ({report.first_problem})")
    return out, report


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _example(ids: list[int], mask: list[int], uid: str) -> Completion:
    """A trained sequence as a :class:`Completion`: the untrained head is the prompt."""
    start = mask.index(1)
    return Completion(
        ids[:start],
        ids[start:],
        [0.0] * (len(ids) - start),
        "stop",
        0,
        0,
        text=uid,
        loss_mask=mask[start:],
    )


def encode_conversation(
    conv: Conversation, tokenizer, *, last_turn_only: bool = False, max_len: int
) -> tuple[list[Completion], bool] | Problem:
    """(examples, segmented) of one conversation, or the problem that makes it a bad row;
    ``segmented``: one example per assistant turn (module docstring)."""
    msgs = conv.messages
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    try:
        # one render refuses a conversation too long before the 2T (quadratic) prefix renders
        last = _ids(tokenizer, msgs[: turns[-1] + 1], False)
        if len(last) > max_len:
            return _too_long(len(last), max_len)
        full = last if turns[-1] == len(msgs) - 1 else _ids(tokenizer, msgs, False)
        spans = [
            (_ids(tokenizer, msgs[:k], True), _ids(tokenizer, msgs[: k + 1], False))
            for k in turns[:-1]
        ]
        spans.append((_ids(tokenizer, msgs[: turns[-1]], True), last))
    except Exception as exc:  # jinja raises its own types (raise_exception in a template)
        return "template_error", f"the chat template cannot render this row ({exc})"
    for n, (head, whole) in enumerate(spans, start=1):
        if whole[: len(head)] != head or len(whole) <= len(head):
            return "template_prefix", (
                f"the chat template renders assistant turn {n} with a different prefix than "
                "its generation prompt; its tokens cannot be masked"
            )
    joint = all(full[: len(w)] == w and full[: len(h)] == h for h, w in spans)
    if joint:
        end = len(spans[-1][1])
        mask = [0] * end
        for head, whole in spans:
            mask[len(head) : len(whole)] = [1] * (len(whole) - len(head))
        pieces = [(full[:end], mask)]
    else:
        pieces = [(w, [0] * len(h) + [1] * (len(w) - len(h))) for h, w in spans]
    longest = max(len(ids) for ids, _ in pieces)
    if longest > max_len:
        return _too_long(longest, max_len)
    return [_example(ids, mask, conv.uid) for ids, mask in pieces], not joint


def _too_long(tokens: int, max_len: int) -> Problem:
    return "too_long", f"the conversation is {tokens} tokens; the context holds {max_len}"


def encode_conversations(
    convs: list[Conversation],
    tokenizer,
    *,
    last_turn_only: bool,
    max_len: int,
    on_bad_row: str,
    report: LoadReport,
) -> list[Completion]:
    """Every conversation's examples; a row that cannot be encoded is refused or skipped and
    counted in ``report`` (as a load problem is)."""
    out: list[Completion] = []
    for conv in convs:
        got = encode_conversation(conv, tokenizer, last_turn_only=last_turn_only, max_len=max_len)
        if isinstance(got, tuple) and isinstance(got[0], str):
            refuse_or_skip(conv.uid, got, on_bad_row, report)
            report.rows -= 1
            continue
        out.extend(got[0])
    if convs and not out:
        raise DataError(f"no conversation could be encoded ({report.first_problem})")
    return out


def prompt_for_answer(conv: Conversation, tokenizer) -> str:
    """The conversation before its last assistant turn, with the generation prompt: what the
    model answers when its held-out accuracy is measured."""
    return tokenizer.apply_chat_template(
        conv.messages[:-1], tokenize=False, add_generation_prompt=True
    )


def chat_arith(size: int, seed: int = 0) -> list[Conversation]:
    """A tiny built-in set of two- or three-turn arithmetic chats, some with a system message
    or a calculator call; the answer is the last turn's result."""
    rng = random.Random(seed)
    out = []
    for i in range(size):
        a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
        msgs: list[dict[str, Any]] = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": "Answer with a number."})
        msgs += [{"role": "user", "content": f"{a}+{b}?"}]
        if i % 4 == 1:
            call = {"type": "function", "function": {"name": "add", "arguments": f"{a},{b}"}}
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": str(a + b)},
            ]
        msgs += [
            {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": f"+{c}?"},
            {"role": "assistant", "content": str(a + b + c)},
        ]
        out.append(Conversation(msgs, a + b + c, f"chat_arith:{i + 1}"))
    return out
