"""OpenAI response bodies for ``rlpost serve``: whole responses and streamed chunks.

Each choice, and each streamed chunk, also carries its ``token_ids`` and ``policy_version``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from rlpost.rollout.engines.scheduler import SampleOutput, TokenEvent


def format_choice(index: int, out: SampleOutput, tokenizer, *, chat: bool, logprobs: bool) -> dict:
    """One OpenAI choice plus the RL fields: sampled ``token_ids`` and the policy versions."""
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    text = text[: out.text_end] if out.text_end is not None else text
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = chat_logprobs(out, tokenizer) if logprobs else None
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(out, tokenizer) if logprobs else None
    choice.update(
        finish_reason=out.finish_reason,
        token_ids=out.token_ids,
        policy_version=out.policy_version,
        policy_versions=out.versions,
    )
    return choice


_PIECES: dict[int, dict[int, str]] = {}  # id(tokenizer) -> token id -> its text alone


def piece(tokenizer, token_id: int) -> str:
    """``tokenizer.decode([token_id])``, remembered: top logprobs name twenty tokens a
    step per sample, and a decode call costs far more than a lookup."""
    table = _PIECES.get(id(tokenizer))
    if table is None:  # it holds its tokenizer (at -1), so the id is not reused meanwhile
        table = _PIECES[id(tokenizer)] = {-1: tokenizer}
    text = table.get(token_id)
    if text is None:
        text = table[token_id] = tokenizer.decode([token_id])
    return text


def completion_logprobs(out: SampleOutput, tokenizer) -> dict:
    """The OpenAI completions ``logprobs`` object for one choice."""
    pieces = [piece(tokenizer, t) for t in out.token_ids]
    tops = None
    if out.top_logprobs is not None:
        tops = [{piece(tokenizer, t): lp for t, lp in alts} for alts in out.top_logprobs]
    offsets = [0, *accumulate(len(p) for p in pieces)][: len(pieces)]
    body = {"tokens": pieces, "token_logprobs": out.logprobs}
    return {**body, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(out: SampleOutput, tokenizer) -> dict:
    """The OpenAI chat ``logprobs`` object (``content`` list) for one choice."""

    def entry(token_id: int, logprob: float) -> dict:
        text = piece(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    tops = out.top_logprobs or [[] for _ in out.token_ids]
    content = [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
        for t, lp, alts in zip(out.token_ids, out.logprobs, tops, strict=True)
    ]
    return {"content": content}


class ChoiceStream:
    """One streamed choice: the text sent so far, holding back ``holdback`` characters (where
    a stop text may begin) and a trailing U+FFFD."""

    def __init__(self, index: int, tokenizer, holdback: int, *, chat: bool) -> None:
        self.index, self.tokenizer, self.holdback, self.chat = index, tokenizer, holdback, chat
        self.tokens: list[int] = []
        self.sent = 0

    def chunk(self, event: TokenEvent, logprobs: bool) -> dict:
        """The choice object of the chunk that adds ``event``'s token."""
        self.tokens.append(event.token_id)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if event.finish is not None:
            end = event.text_end if event.text_end is not None else len(text)
        else:
            end = len(text) - self.holdback
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        start, self.sent = self.sent, max(self.sent, end)
        piece = text[start : self.sent]
        top = None if event.top is None else [event.top]
        one = SampleOutput(
            [event.token_id], [event.logprob], event.finish, [event.version], None, top
        )
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            delta = {"content": piece}
            if len(self.tokens) == 1:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(one, self.tokenizer) if logprobs else None
        else:
            choice["text"] = piece
            lp = completion_logprobs(one, self.tokenizer) if logprobs else None
            if lp is not None:
                lp["text_offset"] = [start]
            choice["logprobs"] = lp
        choice.update(
            finish_reason=event.finish, token_ids=[event.token_id], policy_version=event.version
        )
        return choice
