"""Multi-turn rollouts with tools, token in and token out.

A conversation is one growing token list: the prompt, the policy's turn, the
tool's output, the policy again. Each policy turn is an engine call that
continues the whole list (an rlpost server's prefix cache reuses the KV of
everything before the new tokens). Tool output is tokenized once and appended
as tokens with ``loss_mask`` 0 and logprob 0.0, so the trainer sees exactly
the ids the policy was conditioned on and never learns to produce tool text;
the text is never re-tokenized, so no token boundary can shift between turns.

A call is written ``<tool name="NAME">ARGUMENTS</tool>`` by default
(:class:`ToolFormat` swaps the pattern and the result template). The policy's
turn is cut right after the first complete call; the tokens it sampled past
that point were never seen by the tool and are discarded. A tool is a Python
callable ``fn(arguments: str) -> str``, an :class:`HttpTool` or a
:class:`CodeTool`, which runs the arguments as Python in the rlpost sandbox
(bubblewrap; it refuses to run if the sandbox is unavailable). A tool that
raises answers ``error: ...`` to the policy and is counted; it never ends the
rollout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import httpx

from rlpost.rollout.protocol import RolloutEngine, SamplingParams
from rlpost.types import Completion, FinishReason

Tool = Callable[[str], str]


class HttpTool:
    """A tool behind an HTTP endpoint: POST ``{"arguments": ...}``, answer ``{"output": ...}`` or text."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url
        self.timeout = timeout

    def __call__(self, arguments: str) -> str:
        r = httpx.post(self.url, json={"arguments": arguments}, timeout=self.timeout)
        r.raise_for_status()
        try:
            body = r.json()
        except ValueError:
            return r.text
        return str(body.get("output", body)) if isinstance(body, dict) else str(body)


class CodeTool:
    """Runs the arguments as a Python program in the sandbox; answers stdout (and the error, if any)."""

    def __init__(self, config=None) -> None:
        self.config = config

    def __call__(self, code: str) -> str:
        from rlpost.rewards.sandbox import run_code

        result = run_code(code, config=self.config)
        if result.ok:
            return result.stdout
        tail = (result.stderr.strip().splitlines() or [""])[-1]
        return f"{result.stdout}[{result.status}] {tail}".strip()


@dataclass
class ToolFormat:
    """How a call is recognised in the policy's text and how its result is shown back."""

    call: re.Pattern = re.compile(r'<tool name="([\w.-]+)">(.*?)</tool>', re.S)
    result: str = "<result>{output}</result>"
    max_output_chars: int = 2000


@dataclass
class _Conversation:
    prompt_ids: list[int]
    group: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    version: int | None = None
    calls: int = 0
    finish: FinishReason | None = None


class MultiTurnRollout:
    """Samples conversations in which the policy may call ``tools`` up to ``max_calls`` times.

    ``params.max_tokens`` bounds the whole response (policy and tool tokens);
    ``max_tool_tokens`` bounds one tool answer.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        tools: dict[str, Tool],
        *,
        max_calls: int = 4,
        max_tool_tokens: int = 256,
        fmt: ToolFormat | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = dict(tools)
        self.max_calls = max_calls
        self.max_tool_tokens = max_tool_tokens
        self.fmt = fmt or ToolFormat()
        self.tool_calls = 0
        self.tool_errors = 0

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1, group_offset: int = 0
    ) -> list[Completion]:
        """``n`` conversations per prompt, grouped like :meth:`RolloutEngine.generate`."""
        convs = [
            _Conversation(list(p), group_offset + i)
            for i, p in enumerate(prompt_ids)
            for _ in range(n)
        ]
        # First turn: one call with n samples per prompt, so each prompt is prefilled once.
        first = self.engine.generate(prompt_ids, params, n=n, group_offset=group_offset)
        self._take_turns(convs, first, params)
        while active := [c for c in convs if c.finish is None]:
            self._next_turn(active, params)
        return [self._completion(c) for c in convs]

    def _next_turn(self, active: list[_Conversation], params: SamplingParams) -> None:
        budgets = [params.max_tokens - len(c.tokens) for c in active]
        for limit in sorted(set(budgets)):
            batch = [c for c, b in zip(active, budgets, strict=True) if b == limit]
            ids = [c.prompt_ids + c.tokens for c in batch]
            out = self.engine.generate(ids, replace(params, max_tokens=limit), n=1)
            self._take_turns(batch, out, params)

    def _take_turns(
        self, convs: list[_Conversation], outs: list[Completion], params: SamplingParams
    ) -> None:
        """Append each policy turn; run the calls they end with; set finish where the conversation ends."""
        calls = []
        for conv, out in zip(convs, outs, strict=True):
            if conv.version is None:
                conv.version = out.policy_version
            call = self._find_call(out.token_ids) if conv.calls < self.max_calls else None
            keep = out.token_ids if call is None else out.token_ids[: call[0]]
            conv.tokens += keep
            conv.logprobs += out.logprobs[: len(keep)]
            conv.loss_mask += [1] * len(keep)
            if call is None:
                conv.finish = (
                    "length" if len(conv.tokens) >= params.max_tokens else out.finish_reason
                )
            elif len(conv.tokens) >= params.max_tokens:
                conv.finish = "length"
            else:
                calls.append((conv, call[1], call[2]))
        if not calls:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(calls))) as pool:
            answers = list(pool.map(lambda c: self._run_tool(c[1], c[2]), calls))
        self.tool_calls += len(calls)
        for (conv, _, _), (answer, failed) in zip(calls, answers, strict=True):
            self.tool_errors += failed
            self._append_tool_output(conv, answer, params)

    def _find_call(self, token_ids: list[int]) -> tuple[int, str, str] | None:
        """(tokens to keep, tool name, arguments) of the first complete call in a turn, or None."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        match = self.fmt.call.search(text)
        if match is None:
            return None
        # The shortest token prefix whose text contains the whole call.
        for k in range(1, len(token_ids) + 1):
            if len(self.tokenizer.decode(token_ids[:k], skip_special_tokens=True)) >= match.end():
                return k, match.group(1), match.group(2)
        return len(token_ids), match.group(1), match.group(2)

    def _run_tool(self, name: str, arguments: str) -> tuple[str, bool]:
        """(answer shown to the policy, whether the call failed)."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available: {', '.join(sorted(self.tools))}", True
        try:
            return str(tool(arguments)), False
        except Exception as exc:  # the policy sees the failure; the rollout goes on
            line = (str(exc).strip().splitlines() or [""])[0]
            return f"error: {type(exc).__name__}: {line}", True

    def _append_tool_output(self, conv: _Conversation, answer: str, params: SamplingParams) -> None:
        text = self.fmt.result.format(output=answer[: self.fmt.max_output_chars])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_tool_tokens]
        room = params.max_tokens - len(conv.tokens)
        ids = ids[:room]
        conv.tokens += ids
        conv.logprobs += [0.0] * len(ids)
        conv.loss_mask += [0] * len(ids)
        conv.calls += 1
        if len(conv.tokens) >= params.max_tokens:
            conv.finish = "length"

    def _completion(self, c: _Conversation) -> Completion:
        return Completion(
            prompt_ids=c.prompt_ids,
            token_ids=c.tokens,
            logprobs=c.logprobs,
            finish_reason=c.finish,
            policy_version=c.version,
            group=c.group,
            text=self.tokenizer.decode(c.tokens, skip_special_tokens=True),
            loss_mask=c.loss_mask,
        )
