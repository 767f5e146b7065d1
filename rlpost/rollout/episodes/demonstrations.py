"""Warm-up examples for an outside agent: OpenAI conversations rendered as the server would.

``{"messages": [...], "tools": [...]}``, rendered by the server's chat template, so the
warm-up trains on the tokens a session records; only assistant spans train.
"""

from __future__ import annotations

from rlpost.rollout.serve.tool_calls import chat_turns
from rlpost.types import Completion


def _render(tokenizer, turns: list[dict], tools, generation: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        turns, tools=tools, add_generation_prompt=generation, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def conversation_example(tokenizer, conversation: dict) -> Completion:
    """The conversation as a warm-up example (ValueError when the template does not render
    its assistant turns as extensions of the chat before them)."""
    turns = chat_turns(conversation.get("messages"))
    tools = conversation.get("tools") or None
    full = _render(tokenizer, turns, tools, generation=False)
    spans = []
    for k, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, turns[:k], tools, generation=True)
        through = _render(tokenizer, turns[: k + 1], tools, generation=False)
        if through[: len(before)] != before or full[: len(through)] != through:
            raise ValueError(f"messages[{k}]: the chat template does not extend the chat there")
        spans.append((len(before), len(through)))
    if not spans:
        raise ValueError("a demonstration needs an assistant message")
    start = spans[0][0]
    mask = [0] * (len(full) - start)
    for lo, hi in spans:
        mask[lo - start : hi - start] = [1] * (hi - lo)
    tokens = full[start:]
    return Completion(full[:start], tokens, [0.0] * len(tokens), "stop", 0, 0, loss_mask=mask)
