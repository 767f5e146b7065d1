"""``tools``: plain Python callables (or HTTP endpoints, or sandboxed code) as an environment.

Stateless: a tool that raises answers ``error: ...`` (counted) and the episode goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from rlpost.envs.base import Action, StepResult
from rlpost.errors import typed_line
from rlpost.types import Prompt

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


class ToolEnv:
    """Stateless tools by name (not registered: it is built from callables in code)."""

    def __init__(self, tools: dict[str, Tool]) -> None:
        self.table = dict(tools)
        self.tools = tuple(sorted(self.table))

    def reset(self, prompt: Prompt) -> None:
        pass  # stateless: nothing to set up per episode

    def step(self, action: Action) -> StepResult:
        if action.call is None:
            return StepResult(done=True)
        tool = self.table.get(action.call.name)
        if tool is None:
            names = ", ".join(self.tools)
            return StepResult(
                f"error: unknown tool {action.call.name!r}; available: {names}", error=True
            )
        try:
            return StepResult(str(tool(action.call.arguments)))
        except Exception as exc:  # the policy sees the failure; the episode goes on
            return StepResult(f"error: {typed_line(exc)}", error=True)
