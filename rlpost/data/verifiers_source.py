"""verifiers environments (extra ``[verifiers]``): loading one, offline, and its dataset as prompts.

The classic API (0.3.1: ``SingleTurnEnv``, ``ToolEnv``, ``Rubric``, ``load_environment``)
that published environments use; 0.4.0's ``Task`` classes are scored by the
``verifiers_rubric`` reward's ``task`` parameter. An environment (an id or
``package.module:function``) loads once per process and argument set; what cannot be had
offline fails in one line naming it. Each row becomes a :class:`Prompt` whose
``metadata["verifiers"]["input"]`` keeps the whole row for the reward and environment.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from typing import Any

from rlpost.data.tasks import TASKS, Splits, generated
from rlpost.registry import import_callable
from rlpost.types import Prompt

SUPPORTED = "0.3.1"
INSTALL = "pip install 'rlpost[verifiers]'"
META = "verifiers"  # the Prompt.metadata key holding the row


class VerifiersError(ValueError):
    """A verifiers environment that cannot be loaded or used here (one line says why)."""


def classic():
    """The classic verifiers API (``import verifiers as vf``), or VerifiersError naming the fix."""
    try:
        import verifiers as vf
    except ImportError:
        raise VerifiersError(f"verifiers is not installed: {INSTALL}") from None
    version = getattr(vf, "__version__", "?")
    try:
        rubric, env = vf.Rubric, vf.MultiTurnEnv
    except (AttributeError, ImportError):
        raise VerifiersError(
            f"verifiers {version} has no classic API (Rubric, MultiTurnEnv, ToolEnv); "
            f"classic environments need verifiers=={SUPPORTED} ({INSTALL}); a 0.4.0 Task's "
            "@vf.reward methods are scored by verifiers_rubric with task=package.module:Class"
        ) from None
    if not hasattr(rubric, "score_group") or not hasattr(env, "init_state"):
        raise VerifiersError(
            f"verifiers {version} is an older classic API generation than the supported "
            f"{SUPPORTED} (Rubric.score_group, Environment.init_state): pip install "
            f"verifiers=={SUPPORTED}"
        )
    return vf


class _Loop:
    """One event loop on a daemon thread for the process, where verifiers' coroutines run from
    any thread, so objects bound to the loop stay usable across calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers-loop", daemon=True).start()

    def run(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_LOOP: _Loop | None = None
_LOCK = threading.Lock()


def run_async(coro: Coroutine) -> Any:
    """The result of ``coro``, run on the verifiers loop."""
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = _Loop()
    return _LOOP.run(coro)


def _offline_cause(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that is a failed download (datasets, the Hub, HTTP)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        module = type(exc).__module__.split(".")[0]
        text = str(exc)
        if module in ("datasets", "huggingface_hub", "requests", "urllib3", "httpx", "httpcore"):
            return exc
        if isinstance(exc, ConnectionError | TimeoutError) or "on the Hub" in text:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _explain(spec: str, exc: Exception) -> VerifiersError:
    cause = _offline_cause(exc)
    if cause is not None:
        detail = str(cause).splitlines()[0] if str(cause) else ""
        return VerifiersError(
            f"verifiers env {spec!r} needs a download that failed here ({type(cause).__name__}: "
            f"{detail}); build its dataset locally (datasets save_to_disk) and pass it "
            "through env_args, or load it where the network is reachable"
        )
    if isinstance(exc, ModuleNotFoundError) or isinstance(exc.__cause__, ModuleNotFoundError):
        missing = getattr(
            exc if isinstance(exc, ModuleNotFoundError) else exc.__cause__, "name", ""
        )
        return VerifiersError(
            f"verifiers env {spec!r}: module {missing!r} is not installed; install the "
            f"environment's package (prime env install {spec}, or pip / uv pip install it)"
        )
    line = str(exc).splitlines()[0] if str(exc) else ""
    return VerifiersError(f"verifiers env {spec!r} failed to load ({type(exc).__name__}: {line})")


_ENVS: dict[str, Any] = {}


def _key(spec: str, env_args: dict | None) -> str:
    return spec + "|" + json.dumps(env_args or {}, sort_keys=True, default=str)


def load_env(spec: str, env_args: dict | None = None):
    """The classic environment ``spec`` names, built (datasets too) once per process and
    argument set."""
    key = _key(spec, env_args)
    if key in _ENVS:
        return _ENVS[key]
    vf = classic()
    if not spec:
        raise VerifiersError("no verifiers environment named; set env (an id or module:function)")
    with _keep_signals():
        try:
            env = _build(vf, spec, dict(env_args or {}))
            env.build_dataset()
            env.build_eval_dataset()
        except VerifiersError:
            raise
        except Exception as exc:
            raise _explain(spec, exc) from None
    if not isinstance(env, vf.Environment):
        raise VerifiersError(
            f"verifiers env {spec!r} is a {type(env).__name__}, not a vf.Environment"
        )
    _ENVS[key] = env
    return env


def _build(vf, spec: str, env_args: dict):
    if ":" not in spec:
        return vf.load_environment(spec, **env_args)
    fn = import_callable(spec, "verifiers env", VerifiersError)
    try:
        return fn(**env_args)
    except TypeError as exc:
        if "argument" in str(exc):
            raise VerifiersError(
                f"verifiers env {spec!r}: bad env_args {sorted(env_args)} ({exc})"
            ) from None
        raise


class _keep_signals:
    """Put back the run's SIGINT / SIGTERM handlers over the exiting ones verifiers installs
    (off the main thread, the install is skipped)."""

    def __enter__(self):
        import signal

        self.signal = signal
        self.main = threading.current_thread() is threading.main_thread()
        self.saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        if not self.main:
            self.real = signal.signal
            signal.signal = lambda sig, handler: self.saved.get(sig)
        return self

    def __exit__(self, *exc) -> None:
        if not self.main:
            self.signal.signal = self.real
            return
        for sig, handler in self.saved.items():
            if handler is not None:
                self.signal.signal(sig, handler)


def _plain(value: Any) -> Any:
    """A dataset value (or pydantic message) as plain JSON-like data."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict)).strip()
    return "" if content is None else str(content)


def row_prompt(row: dict, index: int) -> tuple[Prompt, str | None]:
    """(the prompt of one formatted dataset row, its system message or None)."""
    data = {k: _plain(v) for k, v in row.items()}
    messages = data.get("prompt")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
        data["prompt"] = messages
    if not isinstance(messages, list) or not messages:
        raise VerifiersError(
            f"verifiers row {index}: no prompt messages (got {type(messages).__name__})"
        )
    system = None
    if messages[0].get("role") == "system":
        system = _content(messages[0])
    text = "\n\n".join(_content(m) for m in messages[1 if system is not None else 0 :])
    if isinstance(data.get("info"), str):
        try:
            data["info"] = json.loads(data["info"]) if data["info"] else {}
        except json.JSONDecodeError:
            pass  # the environment's own reader decides what a non-JSON info means
    uid = str(data.get("example_id", index))
    prompt = Prompt(
        text=text, answer=data.get("answer", ""), metadata={META: {"input": data}}, uid=uid
    )
    return prompt, system


def dataset_prompts(dataset, limit: int | None) -> tuple[list[Prompt], str | None]:
    """(prompts of a formatted dataset's first ``limit`` rows, their shared system message)."""
    rows = dataset if limit is None else dataset.select(range(min(limit, len(dataset))))
    out, systems = [], set()
    for i, row in enumerate(rows):
        prompt, system = row_prompt(dict(row), i)
        systems.add(system)
        out.append(prompt)
    if len(systems) == 1:
        return out, next(iter(systems))
    for p in out:  # rows with their own system messages: each keeps its own, as text
        messages = p.metadata[META]["input"]["prompt"]
        if messages[0].get("role") == "system":
            p.text = f"{_content(messages[0])}\n\n{p.text}"
    return out, None


def env_splits(c) -> tuple[list[Prompt], list[Prompt], str | None, dict[str, Any]]:
    """(train prompts, held-out prompts, system prompt, what was loaded) of one source's
    environment (``c``: its VerifiersSourceConfig)."""
    env = load_env(c.env, c.env_args)
    train, system = ([], None)
    if env.dataset is not None:
        train, system = dataset_prompts(env.dataset, c.train_size)
    held_out: list[Prompt] = []
    if env.eval_dataset is not None and c.eval_size != 0:
        held_out, eval_system = dataset_prompts(env.eval_dataset, c.eval_size)
        system = system if train else eval_system
    if not train and not held_out:
        raise VerifiersError(f"verifiers env {c.env!r} has no dataset rows")
    first = (train or held_out)[0]
    try:  # what verifiers refuses in a row (a plain-string task column) fails now, not mid-run
        new_state(classic(), env, row_input(first.text, first.answer, first.metadata))
    except (ValueError, TypeError, KeyError) as exc:
        raise VerifiersError(
            f"verifiers env {c.env!r}: its first row cannot start a rollout "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    info = {"env": c.env, "class": type(env).__name__, "train": len(train), "eval": len(held_out)}
    return train, held_out, system, info


@TASKS.register("verifiers")
def load_dataset(c, *, template: str, **_) -> Splits:
    train, held_out, system, _ = env_splits(c)
    return generated(train, held_out, template, system_prompt=system)


def row_input(prompt_text: str, answer: Any, metadata: dict | None) -> dict:
    """The verifiers rollout input of a prompt: its kept row, or one made from the text."""
    kept = (metadata or {}).get(META)
    if isinstance(kept, dict) and isinstance(kept.get("input"), dict):
        return kept["input"]
    info = dict(metadata or {})
    return {
        "prompt": [{"role": "user", "content": prompt_text}],
        "answer": "" if answer is None else answer if isinstance(answer, str) else str(answer),
        "info": info,
        "example_id": 0,
    }


def call_arguments(tool: Any, arguments: str) -> str:
    """A call's argument text as the JSON object verifiers' ToolEnv parses: a JSON object
    as written, else the text as the value of the tool's one parameter."""
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        parsed = None
    if isinstance(parsed, dict):
        return arguments
    import inspect

    try:
        params = [
            p.name
            for p in inspect.signature(tool).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    except (TypeError, ValueError):
        params = []
    if len(params) != 1:
        raise VerifiersError(
            f"tool {getattr(tool, '__name__', tool)!r} takes {len(params)} parameters "
            f"({', '.join(params)}); write its arguments as a JSON object"
        )
    return json.dumps({params[0]: arguments})


def _no_model_client(vf):
    """A vf.Client (init_state wants one) that refuses to be used."""
    cls = _CLIENTS.get("cls")
    if cls is None:
        abstract = getattr(vf.Client, "__abstractmethods__", ())
        body = {name: _refuse for name in abstract}
        body["__init__"] = lambda self: None
        cls = _CLIENTS["cls"] = type("RlpostNoModelClient", (vf.Client,), body)
    return cls()


def _refuse(self, *args, **kwargs):
    # an environment that asks a model itself has none: rlpost's engine writes the turns
    raise VerifiersError(
        "this verifiers environment calls its model client; under rlpost the policy's turns "
        "come from the rollout engine and no other model is reachable through it"
    )


_CLIENTS: dict[str, type] = {}


def new_state(vf, env, input_row: dict):
    """A verifiers State for one rollout of ``input_row``, made by the environment's own
    ``init_state`` (without an environment: the same fields, by hand)."""
    if env is not None:
        return run_async(env.init_state(input_row, _no_model_client(vf), "rlpost"))
    from copy import deepcopy

    from verifiers.types import RolloutTiming, State, flatten_task_input
    from verifiers.utils.message_utils import normalize_messages

    row = deepcopy(input_row)
    task = flatten_task_input(row)
    state = State(input=task)
    state["task"] = task
    state["prompt"] = normalize_messages(task.get("prompt", []), field_name="input.prompt")
    for key, value in (("is_completed", False), ("is_truncated", False), ("tool_defs", [])):
        state[key] = value
    state.update(trajectory=[], completion=None, reward=None, metrics=None, error=None)
    state.update(final_env_response=None, timing=RolloutTiming(), trajectory_id="rlpost")
    return state


def trajectory_step(prompt_messages: list, completion_messages: list, trajectory_id: str) -> dict:
    """One model turn as verifiers records it (no tokens: rlpost keeps those)."""
    return {
        "prompt": list(prompt_messages),
        "completion": list(completion_messages),
        "response": None,
        "tokens": None,
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": trajectory_id,
        "extras": {},
    }
