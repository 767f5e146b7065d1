"""``python``: run code in the rlpost sandbox, with the task's tests as feedback.

``<python>...</python>`` runs in the sandbox against ``metadata["tests"]``; the answer is how
many passed and the last error line (without tests, the output). A turn without a call is
the final program. Without a sandbox the call answers an error, never runs unconfined.
"""

from __future__ import annotations

import random
from typing import Any

from rlpost.envs.base import (
    Action,
    Demonstration,
    EnvError,
    StepResult,
    ToolCall,
    environment,
)
from rlpost.errors import one_line
from rlpost.types import Prompt


@environment("python")
class PythonSandbox:
    """Runs the policy's Python in the sandbox; answers test results (or stdout)."""

    tools = ("python",)

    def __init__(self, *, sandbox: dict[str, Any] | None = None, pass_reward: float = 0.0) -> None:
        from rlpost.rewards.sandbox import SandboxConfig

        try:  # checked here, at load: a bad key would otherwise fail every call of the run
            self.config = SandboxConfig(**sandbox) if sandbox else None
        except (TypeError, ValueError) as exc:
            keys = ", ".join(SandboxConfig.__dataclass_fields__)
            raise EnvError(
                f"python sandbox={sandbox!r}: {one_line(exc)}; its keys: {keys}"
            ) from None
        self.pass_reward = pass_reward  # per call, times the fraction of tests passed

    def reset(self, prompt: Prompt) -> None:
        self.tests = list(prompt.metadata.get("tests") or [])

    def step(self, action: Action) -> StepResult:
        if action.call is None:
            return StepResult(done=True)
        from rlpost.rewards.sandbox import SandboxUnavailable, run_code, run_python_tests

        config = self.config
        code = action.call.arguments
        try:
            if not self.tests:
                result = run_code(code, config=config)
                tail = (result.stderr.strip().splitlines() or [""])[-1]
                text = result.stdout if result.ok else f"{result.stdout}[{result.status}] {tail}"
                return StepResult(text.strip(), error=not result.ok)
            fraction, result = run_python_tests(code, self.tests, config=config)
        except SandboxUnavailable as exc:
            return StepResult(f"error: sandbox unavailable: {exc}", error=True)
        passed = round(fraction * len(self.tests))
        text = f"passed {passed}/{len(self.tests)} tests"
        lines = result.stderr.strip().splitlines()
        if lines and passed < len(self.tests):
            text += f"; {lines[-1][:200]}"
        return StepResult(text, reward=self.pass_reward * fraction, error=passed == 0)

    def demonstration(self, prompt: Prompt, rng: random.Random) -> Demonstration | None:
        """Test the reference program (its passing stated, not run), then give it as the answer."""
        if not isinstance(prompt.answer, str):
            return None
        tests = prompt.metadata.get("tests") or []
        call = ToolCall("python", prompt.answer)
        if not tests:
            return [call, prompt.answer]
        return [(call, f"passed {len(tests)}/{len(tests)} tests"), prompt.answer]
