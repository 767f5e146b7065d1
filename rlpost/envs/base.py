"""The environment protocol: what a multi-turn episode talks to between the policy's turns.

An environment is created per episode, ``reset`` with the episode's prompt,
then ``step``-ped with each policy turn. A turn is an :class:`Action`: the text
the policy wrote and the tool call parsed from it (``None`` when the turn calls
no tool, i.e. it answers). The environment returns a :class:`StepResult`: the
observation shown to the policy next (tool output, test results, feedback on a
partial step), a reward for the turn (process reward; 0 when it has none), whether
the episode is done, and whether the call failed (counted, never fatal).

The outcome of the episode is judged by the run's reward terms on the policy's
final turn, exactly as a single-turn completion is; the per-turn rewards an
environment gives are added on top, at the last token of the turn that earned
them. Environments are plain classes registered by name
(``@environment("calc")``) or loaded from ``package.module:Class``; every
built-in one passes the same contract test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rlpost.registry import Registry, UserCodeError, where
from rlpost.types import Prompt


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote: the tool's name and its argument text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Action:
    """One policy turn as the environment sees it: its text and the call it ends with."""

    text: str
    call: ToolCall | None = None


@dataclass
class StepResult:
    """What the environment answers to one turn."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    error: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. ``tools``: the names the policy may call."""

    tools: tuple[str, ...]

    def reset(self, prompt: Prompt) -> None:
        """Start an episode on ``prompt`` (its answer and metadata are the task's)."""
        ...

    def step(self, action: Action) -> StepResult:
        """Answer one policy turn."""
        ...


def checked_step(env: Environment, action: Action) -> StepResult:
    """``env.step(action)``; an answer that is no StepResult is a UserCodeError naming the
    environment's class, its file and line, and the turn."""
    result = env.step(action)
    if not isinstance(result, StepResult):
        turn = action.text if len(action.text) <= 60 else action.text[:57] + "..."
        raise UserCodeError(
            f"environment {where(type(env))}: step() returned {type(result).__name__}, not a"
            f" StepResult, on the turn {turn!r}"
        )
    return result


# A demonstration for the warm-up: tool calls and the final answer text. A call's
# observation comes from the environment itself, so it never disagrees with it; a
# (call, observation) pair states it instead, for environments whose steps are too
# costly to run for every warm-up example (a sandbox run).
Demonstration = list[ToolCall | tuple[ToolCall, str] | str]

ENVS: Registry[type] = Registry("environment")


def environment(name: str) -> Callable[[type], type]:
    """Class decorator registering an environment under ``name``."""
    return ENVS.register(name)


class EnvError(ValueError):
    """An environment name or its parameters are wrong (one line names which)."""
