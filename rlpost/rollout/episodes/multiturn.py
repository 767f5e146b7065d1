"""Multi-turn episodes with tools and environments, token in and token out.

An episode is one growing token list: prompt, policy turn, environment answer, policy again.
Each policy turn is an engine call continuing the whole list (prefix caches reuse what came
before; the first turn samples a prompt's ``n`` episodes from one prefill). An answer is
tokenized once and appended with ``loss_mask`` 0 and logprob 0.0; the policy's tokens are
appended as sampled, with their logprobs and versions. Nothing is decoded and re-encoded into
the sequence, so the trainer sees exactly the ids the policy saw and produced, and never
learns to write tool output.

How a call is written is the format's business (:mod:`rlpost.envs.formats`), what it does the
environment's (:mod:`rlpost.envs`). Budgets end runaway episodes and are counted:
``max_turns`` policy turns (a call in the last one is not run) and ``params.max_tokens``
response tokens, policy and environment together (``max_tool_tokens`` bounds one answer). An
environment call that raises answers ``error: ...`` and is counted; it never ends the rollout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from rlpost.envs.base import Action, Environment, StepResult, ToolCall, checked_step
from rlpost.envs.formats import TagFormat
from rlpost.envs.tools import CodeTool, HttpTool, Tool, ToolEnv
from rlpost.errors import typed_line
from rlpost.registry import UserCodeError
from rlpost.rollout.engines.protocol import RolloutEngine, SamplingParams
from rlpost.rollout.longtail import PartialStep
from rlpost.types import Completion, Episode, FinishReason, Prompt, Turn

__all__ = ["CodeTool", "EpisodeStats", "HttpTool", "MultiTurnRollout", "Tool"]


@dataclass
class EpisodeStats:
    """Counts over the episodes of one ``generate`` call (summed; the means are derived)."""

    episodes: int = 0
    policy_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    tokens: int = 0
    turn_budget: int = 0
    token_budget: int = 0

    def metrics(self) -> dict[str, float]:
        """The rollout stage's per-step ``agent_*`` metrics (observe/metrics.py names them)."""
        e = max(self.episodes, 1)
        return {
            "agent_turns_mean": self.policy_turns / e,
            "agent_tool_calls": float(self.tool_calls),
            "agent_tool_calls_mean": self.tool_calls / e,
            "agent_tool_errors": float(self.tool_errors),
            "agent_tool_error_frac": self.tool_errors / max(self.tool_calls, 1),
            "agent_tool_seconds_mean": self.tool_seconds / max(self.tool_calls, 1),
            "agent_episode_tokens_mean": self.tokens / e,
            "agent_turn_budget_frac": self.turn_budget / e,
            "agent_token_budget_frac": self.token_budget / e,
        }


@dataclass
class _Live:
    prompt_ids: list[int]
    group: int
    env: Environment
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    version: int | None = None
    answer: str = ""
    budget: str | None = None
    finish: FinishReason | None = None


@dataclass
class _Group:
    payload: Any
    episodes: list[_Live]
    steps_carried: int = 0

    @property
    def done(self) -> bool:
        return all(e.finish is not None for e in self.episodes)


class MultiTurnRollout:
    """Samples episodes against a fresh environment each (``env()``), or against plain
    ``tools`` (a stateless :class:`ToolEnv`).

    ``params.max_tokens`` bounds the whole response (policy and environment
    tokens); ``max_tool_tokens`` bounds one answer; ``max_turns`` bounds the
    policy's turns. ``last_stats`` holds the counts of the latest ``generate``."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        tools: dict[str, Tool] | None = None,
        *,
        env: Callable[[], Environment] | None = None,
        max_turns: int = 5,
        max_tool_tokens: int = 256,
        max_output_chars: int = 2000,
        fmt=None,
        workers: int = 8,
    ) -> None:
        if (env is None) == (tools is None):
            raise ValueError("MultiTurnRollout takes either tools or env")
        self.engine = engine
        self.tokenizer = tokenizer
        self.make_env = env if env is not None else (lambda: ToolEnv(tools))
        self.max_turns = max_turns
        self.max_tool_tokens = max_tool_tokens
        self.max_output_chars = max_output_chars
        self.fmt = fmt or TagFormat()
        self.workers = workers
        self.last_stats = EpisodeStats()
        self.carried: list[_Group] = []  # partial rollout: episodes continued next step
        self.tool_calls = 0  # over the object's lifetime
        self.tool_errors = 0

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        group_offset: int = 0,
        prompts: list[Prompt] | None = None,
    ) -> list[Completion]:
        """``n`` episodes per prompt, grouped like :meth:`RolloutEngine.generate`.

        ``prompts`` (the task records) reset the environments; without them an
        environment sees the decoded prompt text alone."""
        groups = self._start(prompt_ids, n, prompts)
        live = [e for g in groups for e in g.episodes]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            self._first_turn(groups, params, n, pool)
            while active := [e for e in live if e.finish is None]:
                self._next_turn(active, params, pool)
        return self._finish(groups, group_offset)

    def generate_partial(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int,
        prompts: list[Any],
        *,
        fraction: float,
    ) -> PartialStep:
        """Partial rollout for episodes: start these prompts' episodes beside the ones carried
        from earlier steps, take turns until ``fraction`` of all of them are done, and return
        the groups whose episodes are all done. The others are carried, environment state
        and all, and continue at the next call with the weights of that step (their tokens'
        versions say which weights sampled which turn). ``prompts`` come back as the payloads
        of the returned groups."""
        for g in self.carried:
            g.steps_carried += 1
        new = self._start(prompt_ids, n, prompts)
        groups = self.carried + new
        live = [e for g in groups for e in g.episodes]
        target = math.ceil(fraction * len(live) - 1e-9)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            if new:
                self._first_turn(new, params, n, pool)
            carried = [e for g in self.carried for e in g.episodes if e.finish is None]
            if carried:
                self._next_turn(carried, params, pool)
            while active := [e for e in live if e.finish is None]:
                done = len(live) - len(active)
                if done >= target and any(g.done for g in groups):
                    break
                self._next_turn(active, params, pool)
        ready = [g for g in groups if g.done]
        self.carried = [g for g in groups if not g.done]
        done = sum(e.finish is not None for e in live)
        return PartialStep(
            completions=self._finish(ready, 0),
            payloads=[g.payload for g in ready],
            carried_groups=len(self.carried),
            carried_samples=sum(e.finish is None for g in self.carried for e in g.episodes),
            done_fraction=done / max(1, len(live)),
        )

    def state_dict(self) -> dict[str, Any]:
        """The carried episodes (tokens, logprobs, versions, turns and their environments)."""
        return {"carried": list(self.carried)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.carried = list(state.get("carried", []))

    def _start(self, prompt_ids, n: int, prompts) -> list[_Group]:
        groups = []
        for i, ids in enumerate(prompt_ids):
            payload = prompts[i] if prompts is not None else None
            task = payload if isinstance(payload, Prompt) else Prompt(self.tokenizer.decode(ids))
            episodes = []
            for _ in range(n):
                env = self.make_env()
                env.reset(task)
                episodes.append(_Live(list(ids), i, env))
            groups.append(_Group(payload, episodes))
        return groups

    def _turn_params(self, params: SamplingParams, live: list[_Live]) -> SamplingParams:
        """``params`` that also stop where a call closes, so a calling turn ends there."""
        tools = tuple(dict.fromkeys(t for e in live for t in e.env.tools))
        stops = self.fmt.stop_texts(tools) if tools else ()
        return replace(params, stop_texts=tuple(dict.fromkeys(params.stop_texts + stops)))

    def _first_turn(self, groups: list[_Group], params: SamplingParams, n: int, pool) -> None:
        # One call with n samples per prompt, so each prompt is prefilled once.
        turn = self._turn_params(params, [g.episodes[0] for g in groups])
        first = self.engine.generate([g.episodes[0].prompt_ids for g in groups], turn, n=n)
        self._take_turns([e for g in groups for e in g.episodes], first, params, pool)

    def _finish(self, groups: list[_Group], group_offset: int) -> list[Completion]:
        """The groups' completions (group index ``group_offset + i``), and their counts in
        ``last_stats``."""
        live = [e for g in groups for e in g.episodes]
        out = [
            self._completion(e, group_offset + i) for i, g in enumerate(groups) for e in g.episodes
        ]
        s = self.last_stats = EpisodeStats()
        for e in live:
            calls = [t for t in e.turns if t.role == "policy" and t.tool is not None]
            s.tool_calls += len(calls)
            s.tool_errors += sum(t.error for t in calls)
            s.tool_seconds += sum(t.seconds for t in calls)
            s.policy_turns += sum(t.role == "policy" for t in e.turns)
        s.episodes = len(out)
        s.tokens = sum(len(c.token_ids) for c in out)
        s.turn_budget = sum(e.budget == "turns" for e in live)
        s.token_budget = sum(e.budget == "tokens" for e in live)
        self.tool_calls += s.tool_calls
        self.tool_errors += s.tool_errors
        return out

    def _next_turn(self, active: list[_Live], params: SamplingParams, pool) -> None:
        # Episodes with the same room left go in one engine call (one max_tokens each).
        budgets = [params.max_tokens - len(e.tokens) for e in active]
        for limit in sorted(set(budgets)):
            batch = [e for e, b in zip(active, budgets, strict=True) if b == limit]
            ids = [e.prompt_ids + e.tokens for e in batch]
            turn = self._turn_params(replace(params, max_tokens=limit), batch)
            out = self.engine.generate(ids, turn, n=1)
            self._take_turns(batch, out, params, pool)

    def _take_turns(
        self, live: list[_Live], outs: list[Completion], params: SamplingParams, pool
    ) -> None:
        """Append each policy turn, step the environments (in parallel), append their answers."""
        steps = []
        for ep, out in zip(live, outs, strict=True):
            if ep.version is None:
                ep.version = out.policy_version
            last_turn = sum(t.role == "policy" for t in ep.turns) + 1 >= self.max_turns
            cut, call = self._find_call(out.token_ids, ep.env.tools)
            keep = out.token_ids[:cut]
            start = len(ep.tokens)
            ep.tokens += keep
            ep.logprobs += out.logprobs[: len(keep)]
            ep.loss_mask += [1] * len(keep)
            ep.versions += out.versions_per_token()[: len(keep)]
            text = self.tokenizer.decode(keep, skip_special_tokens=True)
            tool = call.name if call else None
            args = call.arguments if call else None
            ep.turns.append(Turn("policy", start, len(ep.tokens), tool, text=text, arguments=args))
            ep.answer = text
            full = len(ep.tokens) >= params.max_tokens
            if call is not None and (last_turn or full):
                ep.finish, ep.budget = "length", "turns" if last_turn else "tokens"
                ep.turns[-1].tool = None  # the call is never run
            elif full:
                ep.finish, ep.budget = "length", "tokens"
            elif call is None and out.finish_reason != "stop":
                ep.finish = out.finish_reason
            else:
                steps.append((ep, Action(text, call)))
        if not steps:
            return
        results = list(pool.map(lambda s: self._step(s[0].env, s[1]), steps))
        for (ep, action), (result, seconds) in zip(steps, results, strict=True):
            turn = ep.turns[-1]
            turn.reward, turn.error = float(result.reward), bool(result.error)
            turn.seconds = seconds if action.call is not None else 0.0
            if result.done:
                ep.finish = "stop"
            elif sum(t.role == "policy" for t in ep.turns) >= self.max_turns:
                ep.finish, ep.budget = "length", "turns"
            else:
                self._append_answer(ep, result.observation, params)

    def _find_call(
        self, token_ids: list[int], tools: tuple[str, ...]
    ) -> tuple[int, ToolCall | None]:
        """(tokens of the turn to keep, the first complete call in it or None)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        found = self.fmt.find_call(text, tools)
        if found is None:
            return len(token_ids), None
        end, call = found
        if not self.fmt.cut_after_call:
            return len(token_ids), call
        # The shortest token prefix whose text holds the whole call (decoded length grows
        # with the prefix, so a binary search finds it).
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(token_ids[:mid], skip_special_tokens=True)) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo, call

    @staticmethod
    def _step(env: Environment, action: Action) -> tuple[StepResult, float]:
        """(the environment's answer, seconds it took). An unknown tool or a raising
        environment answers an error instead of ending the rollout."""
        t0 = time.perf_counter()
        if action.call is not None and action.call.name not in env.tools:
            names = ", ".join(env.tools)
            result = StepResult(
                f"error: unknown tool {action.call.name!r}; available: {names}", error=True
            )
        else:
            try:
                result = checked_step(env, action)
            except UserCodeError:  # a broken contract, not a failed call: the run stops
                raise
            except Exception as exc:  # the policy sees the failure; the rollout goes on
                result = StepResult(f"error: {typed_line(exc)}", error=True)
        return result, time.perf_counter() - t0

    def _wrapped_ids(self, output: str) -> list[int]:
        """The tokens of ``output`` in the format's wrapper, at most ``max_tool_tokens``: the
        output is cut, never the wrapper (a cut closing tag, or a chat template's
        turn markers, would leave the next policy turn inside the tool message)."""

        def encode(text: str) -> list[int]:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

        ids = encode(self.fmt.observation_text(output))
        if len(ids) <= self.max_tool_tokens:
            return ids
        room = max(0, self.max_tool_tokens - len(encode(self.fmt.observation_text(""))))
        kept = encode(output)[:room]
        while True:  # merges across the seams can add a token or two: cut until it fits
            cut = self.tokenizer.decode(kept, skip_special_tokens=True)
            ids = encode(self.fmt.observation_text(cut))
            if len(ids) <= self.max_tool_tokens or not kept:
                return ids  # (a wrapper longer than the limit is kept whole)
            kept = kept[: -max(1, len(ids) - self.max_tool_tokens)]

    def _append_answer(self, ep: _Live, observation: str, params) -> None:
        ids = self._wrapped_ids(str(observation)[: self.max_output_chars])
        ids = ids[: params.max_tokens - len(ep.tokens)]
        start = len(ep.tokens)
        ep.tokens += ids
        ep.logprobs += [0.0] * len(ids)
        ep.loss_mask += [0] * len(ids)
        # Masked tokens carry the version of the policy turn they answer (sample lag is
        # measured on what the policy sampled).
        ep.versions += [ep.versions[-1] if ep.versions else ep.version or 0] * len(ids)
        shown = self.tokenizer.decode(ids, skip_special_tokens=True)
        ep.turns.append(Turn("env", start, len(ep.tokens), text=shown))
        if len(ep.tokens) >= params.max_tokens:
            ep.finish, ep.budget = "length", "tokens"

    def _completion(self, e: _Live, group: int) -> Completion:
        return Completion(
            prompt_ids=e.prompt_ids,
            token_ids=e.tokens,
            logprobs=e.logprobs,
            finish_reason=e.finish,
            policy_version=e.version,
            group=group,
            text=self.tokenizer.decode(e.tokens, skip_special_tokens=True),
            loss_mask=e.loss_mask,
            token_versions=e.versions,
            episode=Episode(e.turns, e.answer, e.budget),
        )
