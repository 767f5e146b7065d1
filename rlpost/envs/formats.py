"""How a tool call is written by the policy and how the environment's answer is shown back.

Two formats:

* :class:`TagFormat` (plain tags, the default): a call is the ``call`` template
  filled in (``<{name}>{arguments}</{name}>``: ``<calc>2*3</calc>``), only the
  environment's own tool names count as calls (so an ``<answer>`` tag is not
  one), and the answer is shown as the ``result`` template
  (``<result>{output}</result>``). The policy's turn is cut right after the
  call: the tokens it sampled past it were never seen by the tool.
* :class:`ChatTemplateFormat`: the tokenizer chat template's tool format. A
  call is ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the
  Hermes / Qwen convention those templates document), the turn runs to the
  end-of-turn token, and the answer is the template's rendering of a ``tool``
  message followed by the next assistant header, so the tokens between turns
  are exactly the ones the template would produce.

Either way the answer is tokenized once and appended as tokens; the policy's
own tokens are never decoded and re-encoded.
"""

from __future__ import annotations

import json
import random
import re

from rlpost.data import safe_json
from rlpost.envs.base import Action, Demonstration, EnvError, Environment, ToolCall, checked_step
from rlpost.types import Completion, Prompt

_MARK = "\x00OBSERVATION\x00"


class TagFormat:
    """Plain-tag tool calls. ``call`` holds ``{arguments}`` once and ``{name}`` (optional when
    the environment has a single tool); ``result`` holds ``{output}``."""

    cut_after_call = True

    def __init__(
        self, call: str = "<{name}>{arguments}</{name}>", result: str = "<result>{output}</result>"
    ) -> None:
        if call.count("{arguments}") != 1:
            raise EnvError(f"agent.call_template={call!r} must contain {{arguments}} exactly once")
        if "{output}" not in result:
            raise EnvError(f"agent.result_template={result!r} must contain {{output}}")
        self.call, self.result = call, result
        self._patterns: dict[tuple[str, ...], re.Pattern] = {}

    def _pattern(self, tools: tuple[str, ...]) -> re.Pattern:
        if tools not in self._patterns:
            if "{name}" not in self.call and len(tools) != 1:
                raise EnvError(
                    f"agent.call_template={self.call!r} has no {{name}} but the environment has "
                    f"{len(tools)} tools ({', '.join(tools)}); add {{name}} to the template"
                )
            names = "|".join(re.escape(t) for t in sorted(tools, key=len, reverse=True))
            if self.call.split("{name}")[0] not in ("", "<"):
                names = r"[\w.-]+"  # a fixed wrapper: any name is a call (unknown: an error)
            out, seen = "", False
            for part in re.split(r"(\{name\}|\{arguments\})", self.call):
                if part == "{name}":
                    out += "(?P=name)" if seen else f"(?P<name>{names})"
                    seen = True
                elif part == "{arguments}":
                    out += "(?P<arguments>.*?)"
                else:
                    out += re.escape(part)
            self._patterns[tools] = re.compile(out, re.S)
        return self._patterns[tools]

    def check(self, tools: tuple[str, ...]) -> None:
        """Raise EnvError now if the call template cannot name these tools (not at the first
        policy turn of a run)."""
        if tools:
            self._pattern(tools)

    def find_call(self, text: str, tools: tuple[str, ...]) -> tuple[int, ToolCall] | None:
        """(end of the first complete call in ``text``, the call), or None (always, for an
        environment without tools)."""
        if not tools:
            return None
        m = self._pattern(tools).search(text)
        if m is None:
            return None
        name = m.groupdict().get("name") or tools[0]
        return m.end(), ToolCall(name, m.group("arguments"))

    def render_call(self, call: ToolCall) -> str:
        return self.call.replace("{name}", call.name).replace("{arguments}", call.arguments)

    def stop_texts(self, tools: tuple[str, ...]) -> tuple[str, ...]:
        """What closes a call (the template after ``{arguments}``, per tool): the engine stops
        there, so a calling turn is not decoded past its call."""
        close = self.call.split("{arguments}", 1)[1]
        if not close:
            return ()
        return tuple(dict.fromkeys(close.replace("{name}", t) for t in tools))

    def observation_text(self, output: str) -> str:
        return self.result.replace("{output}", output)


class ChatTemplateFormat:
    """Tool calls in the tokenizer chat template's format (see the module docstring)."""

    cut_after_call = False
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise EnvError(
                "agent.format=chat_template: the tokenizer has no chat template; "
                "use agent.format=tags"
            )
        self.eos = tokenizer.eos_token or ""
        user = {"role": "user", "content": "u"}
        assistant = {"role": "assistant", "content": "a"}
        tool = {"role": "tool", "content": _MARK}
        try:
            base = tokenizer.apply_chat_template([user, assistant], tokenize=False)
            full = tokenizer.apply_chat_template(
                [user, assistant, tool], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template that cannot render tool messages is refused once
            raise EnvError(f"agent.format=chat_template: the chat template fails ({exc})") from None
        if not full.startswith(base) or _MARK not in full[len(base) :]:
            raise EnvError(
                "agent.format=chat_template: the chat template does not render a tool message "
                "after an assistant turn; use agent.format=tags"
            )
        # Text the template puts after the assistant's content: its end-of-turn token (which
        # the policy sampled itself, as its stop token) and whatever follows it.
        tail = base[base.rindex("a") + 1 :]
        tail = tail[len(self.eos) :] if self.eos and tail.startswith(self.eos) else tail
        self.prefix, self.suffix = (tail + full[len(base) :]).split(_MARK)

    def check(self, tools: tuple[str, ...]) -> None:
        """Any tool names work in this format (an unknown one is answered with an error)."""

    def find_call(self, text: str, tools: tuple[str, ...]) -> tuple[int, ToolCall] | None:
        m = self._CALL.search(text) if tools else None
        if m is None:
            return None
        try:
            body = safe_json.loads(m.group(1))  # model output: nesting bounded (TooDeep)
            name, args = str(body["name"]), body.get("arguments", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            return m.end(), ToolCall("", m.group(1))  # malformed: answered with an error
        if isinstance(args, dict) and len(args) == 1:
            args = next(iter(args.values()))  # one-argument tools take the value itself
        return m.end(), ToolCall(name, args if isinstance(args, str) else json.dumps(args))

    def stop_texts(self, tools: tuple[str, ...]) -> tuple[str, ...]:
        """None: a template's call turn ends with its own end-of-turn token after the call."""
        return ()

    def render_call(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        return f"<tool_call>{body}</tool_call>{self.eos}"

    def observation_text(self, output: str) -> str:
        return self.prefix + output + self.suffix


def build_format(kind: str, tokenizer, *, call: str, result: str, chat_prompts: bool = True):
    """The format named by ``agent.format``. ``auto``: the chat template's tool format when the
    prompts are rendered with the template (``chat_prompts``) and it renders tool messages,
    else plain tags."""
    if kind == "chat_template":
        return ChatTemplateFormat(tokenizer)
    if kind == "auto":
        if chat_prompts and getattr(tokenizer, "chat_template", None):
            try:
                return ChatTemplateFormat(tokenizer)
            except EnvError:
                pass  # a template without tool messages: plain tags, as documented
        return TagFormat(call, result)
    if kind == "tags":
        return TagFormat(call, result)
    raise EnvError(f"agent.format={kind!r}: valid formats are auto, tags, chat_template")


def demonstration_completion(
    env: Environment, prompt: Prompt, fmt, tokenizer, rng: random.Random, *, direct: bool = False
) -> Completion | None:
    """A warm-up example of one episode: the environment's demonstration, its tool output
    produced by the environment itself and masked (``loss_mask`` 0), the policy's tokens
    trained. ``direct``: answer without calling a tool. None when the environment has no
    demonstration for this prompt."""
    demonstrate = getattr(env, "demonstration", None)  # optional in the protocol
    demo: Demonstration | None = demonstrate(prompt, rng) if demonstrate else None
    if demo is None:
        return None
    if direct:
        demo = [part for part in demo if isinstance(part, str)]
    env.reset(prompt)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids: list[int] = []
    mask: list[int] = []
    for part in demo:
        if isinstance(part, ToolCall | tuple):
            call, stated = part if isinstance(part, tuple) else (part, None)
            text = fmt.render_call(call)
            ids += encode(text)
            mask += [1] * (len(ids) - len(mask))
            shown = (
                stated if stated is not None else checked_step(env, Action(text, call)).observation
            )
            obs = encode(fmt.observation_text(shown))
            ids += obs
            mask += [0] * len(obs)
        else:
            ids += [*encode(part), tokenizer.eos_token_id]
            mask += [1] * (len(ids) - len(mask))
    prompt_ids = encode(prompt.text)
    return Completion(prompt_ids, ids, [0.0] * len(ids), "stop", 0, 0, loss_mask=mask)
