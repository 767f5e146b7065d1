"""``verifiers``: a classic verifiers environment (``MultiTurnEnv``, ``ToolEnv``, ``SingleTurnEnv``)
driven through rlpost's episode loop (extra ``[verifiers]``).

``agent.env.name=verifiers agent.env.env=<id or package.module:function>``. The environment's
``setup_state`` starts from the prompt's row; each policy turn becomes an assistant message,
then its stop conditions end the episode or its ``env_response`` messages are the next
observation. The outcome is scored by ``verifiers_rubric``; turn rewards are 0.
"""

from __future__ import annotations

from typing import Any

from rlpost.data import verifiers_source as vs
from rlpost.envs.base import Action, EnvError, StepResult, environment
from rlpost.types import Prompt


def _text(messages: list) -> str:
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
        if isinstance(content, list):
            content = " ".join(getattr(p, "text", "") or "" for p in content)
        out.append("" if content is None else str(content))
    return "\n".join(out)


@environment("verifiers")
class VerifiersEnv:
    """One episode of a classic verifiers environment; ``env`` names it, as the
    ``verifiers_rubric`` reward and the ``verifiers`` data source do."""

    def __init__(self, env: str = "", env_args: dict[str, Any] | None = None) -> None:
        try:
            self.vf = vs.classic()
            self.env = vs.load_env(env, env_args)
        except vs.VerifiersError as exc:
            raise EnvError(str(exc)) from None
        if not isinstance(self.env, self.vf.MultiTurnEnv):
            raise EnvError(
                f"verifiers env {env!r} is a {type(self.env).__name__}; the episode loop drives "
                "MultiTurnEnv subclasses (SingleTurnEnv, ToolEnv, ...)"
            )
        self.spec, self.env_args = env, dict(env_args or {})
        self.tools = tuple(getattr(self.env, "tool_map", None) or ())
        self.state = None
        self.messages: list = []
        self.calls = 0

    _UNPICKLED = ("client", "usage_tracker", "usage")  # live objects, made again on load

    def __getstate__(self) -> dict:
        # a carried episode is pickled with its state; the environment is reloaded by name
        state = {k: v for k, v in self.__dict__.items() if k not in ("vf", "env")}
        if self.state is not None:
            state["state"] = {k: v for k, v in self.state.items() if k not in self._UNPICKLED}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.vf = vs.classic()
        self.env = vs.load_env(self.spec, self.env_args)
        if self.state is not None:
            fresh = vs.new_state(self.vf, self.env, self.state["input"])
            for key in self._UNPICKLED:  # (the usage counts restart: rlpost counts tokens)
                self.state[key] = fresh.get(key)
            restored = self.vf.State(input=self.state.pop("input"))
            restored.update(self.state)
            self.state = restored

    def reset(self, prompt: Prompt) -> None:
        row = vs.row_input(prompt.text, prompt.answer, prompt.metadata)
        self.state = vs.new_state(self.vf, self.env, row)
        set_up = vs.run_async(self.env.setup_state(self.state))
        if set_up is not None:
            self.state = set_up
        self.messages = list(self.state["prompt"])

    def _reply(self, action: Action):
        from verifiers.types import AssistantMessage, ToolCall

        calls = None
        if action.call is not None:
            self.calls += 1
            tool = self.env.tool_map.get(action.call.name)
            args = action.call.arguments
            if tool is not None:
                args = vs.call_arguments(tool, args)
            calls = [ToolCall(id=f"call_{self.calls}", name=action.call.name, arguments=args)]
        return AssistantMessage(content=action.text, tool_calls=calls)

    def step(self, action: Action) -> StepResult:
        try:
            reply = self._reply(action)
        except vs.VerifiersError as exc:  # arguments no tool parameter takes: the policy sees why
            return StepResult(f"error: {exc}", error=True)
        step = vs.trajectory_step(self.messages, [reply], self.state["trajectory_id"])
        vs.run_async(self.env.add_trajectory_step(self.state, step))
        self.messages.append(reply)
        if vs.run_async(self.env.is_completed(self.state)):
            return StepResult(done=True)
        answer = vs.run_async(self.env.env_response(list(self.messages), self.state))
        from verifiers.utils.message_utils import maybe_normalize_messages

        answer = maybe_normalize_messages(answer, field_name="env_response")
        self.messages.extend(answer)
        if self.state.get("final_env_response") is not None:
            return StepResult(_text(answer), done=True)
        return StepResult(_text(answer))
