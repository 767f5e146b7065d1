"""The ``verifiers_rubric`` reward: a verifiers environment's rubric scores rlpost's completions.

One of three things names the scoring (extra ``[verifiers]``):

* ``env``: a classic environment (with ``env_args``), whose ``rubric`` scores;
* ``rubric``: ``package.module:name``, a classic ``vf.Rubric`` or a function returning one;
* ``task``: ``package.module:Class``, a 0.4.0 ``Task`` whose ``@vf.reward`` methods score.

Each completion becomes the state verifiers would score (the prompt's row, the completion
as assistant messages), a prompt's completions scored together by ``Rubric.score_group``. The
weighted reward trains; each function's and metric's value is a component
``verifiers_rubric/<name>``. A reward function that raises scores 0, as in verifiers.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Sequence
from typing import Any

from rlpost.data import verifiers_source as vs
from rlpost.registry import import_object
from rlpost.rewards.registry import batched_scorer
from rlpost.types import RewardSample


def _check(
    *, env: str = "", env_args: dict | None = None, rubric: str = "", task: str = ""
) -> None:
    named = [k for k, v in (("env", env), ("rubric", rubric), ("task", task)) if v]
    if len(named) != 1:
        raise ValueError(
            f"name exactly one of env, rubric or task (got {', '.join(named) or 'none'})"
        )
    if env_args and not env:
        raise ValueError("env_args are the environment's; they need env")
    if env:
        vs.load_env(env, env_args)  # loaded once per process; a missing download fails here
    elif rubric:
        _load_rubric(rubric)
    else:
        _load_task(task)


def _row(sample: RewardSample) -> dict:
    """The dataset row verifiers scores ``sample`` against."""
    return vs.row_input(sample.prompt, sample.answer, sample.metadata)


def _import(spec: str, what: str) -> Any:
    try:
        return import_object(spec)
    except ValueError as exc:
        raise vs.VerifiersError(f"{what}={spec!r}: {exc}") from None


def _load_rubric(spec: str):
    vf = vs.classic()
    obj = _import(spec, "rubric")
    if not isinstance(obj, vf.Rubric) and callable(obj):
        obj = obj()
    if not isinstance(obj, vf.Rubric):
        raise vs.VerifiersError(f"rubric={spec!r} is a {type(obj).__name__}, not a vf.Rubric")
    return obj


def _load_task(spec: str) -> type:
    try:
        from verifiers.v1 import Task
    except ImportError:
        raise vs.VerifiersError(
            "task= needs verifiers' Task API (verifiers.v1, in 0.3.1 and 0.4.0): "
            "pip install 'rlpost[verifiers]'"
        ) from None
    cls = _import(spec, "task")
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise vs.VerifiersError(f"task={spec!r} is not a verifiers Task class")
    probe = object.__new__(cls)
    probe.config = cls.config_type()()
    for fn in [*probe.hooks("reward"), *probe.hooks("metric")]:
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            raise vs.VerifiersError(
                f"task={spec!r}: {fn.__name__} needs a runtime (the task's sandbox box), "
                "which rlpost does not provision; only runtime-free rewards are scored"
            )
    return cls


@batched_scorer("verifiers_rubric")
class VerifiersRubric:
    """A verifiers environment's rubric (or a Rubric, or a Task's rewards) on each completion."""

    default_kind = "verifiable"
    check_values = staticmethod(_check)

    def __init__(
        self, env: str = "", env_args: dict | None = None, rubric: str = "", task: str = ""
    ) -> None:
        _check(env=env, env_args=env_args, rubric=rubric, task=task)
        self.vf = vs.classic() if not task else None
        self.env = vs.load_env(env, env_args) if env else None
        self.rubric = (
            self.env.rubric if self.env is not None else (_load_rubric(rubric) if rubric else None)
        )
        self.task_cls = _load_task(task) if task else None
        self.last_components: dict[str, list[float]] = {}

    def state(self, sample: RewardSample):
        """The verifiers State of ``sample``, completion and trajectory filled in."""
        state = vs.new_state(self.vf, self.env, _row(sample))
        prompt, trajectory_id = list(state["prompt"]), state.get("trajectory_id", "")
        state["completion"], state["trajectory"] = self._messages(sample, prompt, trajectory_id)
        state["is_completed"] = True
        state["is_truncated"] = sample.finish_reason == "length"
        return state

    def _messages(self, sample: RewardSample, prompt: list, trajectory_id: str):
        from verifiers.types import AssistantMessage, ToolCall, ToolMessage, UserMessage

        episode = getattr(sample, "episode", None)
        if episode is None or not episode.turns:
            reply = [AssistantMessage(content=sample.completion)]
            return reply, [vs.trajectory_step(prompt, reply, trajectory_id)]
        tools = getattr(self.env, "tool_map", {}) or {}
        messages: list = []
        steps: list = []
        call_id = None
        for i, turn in enumerate(episode.turns):
            if turn.role == "env":
                if call_id is not None:
                    messages.append(ToolMessage(tool_call_id=call_id, content=turn.text))
                else:
                    messages.append(UserMessage(content=turn.text))
                continue
            call_id, calls = None, None
            if turn.tool is not None:
                call_id = f"call_{i}"
                args = getattr(turn, "arguments", None) or ""
                try:
                    args = vs.call_arguments(tools[turn.tool], args) if turn.tool in tools else args
                except vs.VerifiersError:
                    pass  # the call's own text, as the environment got it
                calls = [ToolCall(id=call_id, name=turn.tool, arguments=args)]
            reply = AssistantMessage(content=turn.text, tool_calls=calls)
            steps.append(vs.trajectory_step(prompt + messages, [reply], trajectory_id))
            messages.append(reply)
        return messages, steps

    def _score_classic(self, samples: Sequence[RewardSample]) -> list[float | None]:
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(samples):  # a prompt's completions: one group
            key = (s.prompt, json.dumps(_row(s), sort_keys=True, default=str))
            groups.setdefault(key, []).append(i)
        values: list[float | None] = [None] * len(samples)
        parts: dict[str, list[float]] = {}
        for rows in groups.values():
            states = [self.state(samples[i]) for i in rows]
            vs.run_async(self.rubric.score_group(states))
            for i, st in zip(rows, states, strict=True):
                values[i] = float(st["reward"])
                for name, v in (st.get("metrics") or {}).items():
                    parts.setdefault(name, [math.nan] * len(samples))[i] = float(v)
        self.last_components = parts
        return values

    def _task_data(self, sample: RewardSample):
        data_type = self.task_cls.data_type()
        row = _row(sample)
        info = row.get("info") if isinstance(row.get("info"), dict) else {}
        fields = set(data_type.model_fields)
        given = {**info, **{k: v for k, v in row.items() if k not in ("prompt", "info")}}
        given = {k: v for k, v in given.items() if k in fields}
        given["prompt"] = sample.prompt
        try:
            return data_type.model_validate(given)
        except Exception as exc:  # pydantic's ValidationError: name the first field
            errors = getattr(exc, "errors", lambda: [])()
            where = ".".join(str(x) for x in errors[0]["loc"]) if errors else "?"
            raise vs.VerifiersError(
                f"task {self.task_cls.__name__}: the prompt's row gives no valid {where!r} "
                f"({errors[0]['msg'] if errors else exc}); put it in the row (a file column)"
            ) from None

    async def _score_task(self, sample: RewardSample):
        from verifiers.v1 import (
            AgentConfig,
            AgentInfo,
            AssistantMessage,
            MessageNode,
            Trace,
            TraceTask,
            UserMessage,
        )

        data = self._task_data(sample)
        task = self.task_cls(data)
        nodes = [
            MessageNode(message=UserMessage(content=sample.prompt)),
            MessageNode(
                parent=0, message=AssistantMessage(content=sample.completion), sampled=True
            ),
        ]
        trace = Trace(
            task=TraceTask(type=type(task).__name__, data=data),
            agent=AgentInfo(config=AgentConfig()),
            nodes=nodes,
        )
        await task.score(trace)
        return trace

    def _score_tasks(self, samples: Sequence[RewardSample]) -> list[float | None]:
        values: list[float | None] = []
        parts: dict[str, list[float]] = {}
        for i, s in enumerate(samples):
            trace = vs.run_async(self._score_task(s))
            values.append(float(trace.reward))
            named = {k: (r.score if r is not None else math.nan) for k, r in trace.rewards.items()}
            named |= {k: (math.nan if v is None else v) for k, v in trace.metrics.items()}
            for name, v in named.items():
                parts.setdefault(name, [math.nan] * len(samples))[i] = float(v)
        self.last_components = parts
        return values

    def score(self, samples: Sequence[RewardSample]) -> list[float | None]:
        if not samples:
            self.last_components = {}
            return []
        if self.task_cls is not None:
            return self._score_tasks(samples)
        return self._score_classic(samples)
