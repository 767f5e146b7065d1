"""Bring your own harness: an outside agent, written against the OpenAI API, as the rollout.

For every prompt x ``n`` the runner opens a recorded session when its agent starts (the
session's wall clock is the agent's), runs the agent against the session's base URL, and
turns the finished session into training rows (:func:`rlpost.rollout.serve.sessions.
session_samples`). Sessions live on a loopback OpenAI server over the run's own scheduler
(the engine the trainer syncs into: an update mid-episode lands between two decode steps and
every token keeps the version that sampled it), or, with ``rollout.engine=remote``, on the
rollout servers (:class:`~rlpost.rollout.engines.remote_sessions.RemoteSessions`).

The agent is a callable ``fn(prompt, base_url, **info)`` run in a thread (``info``: those of
``api_key``, ``session_id``, ``metadata`` it accepts), or a command
(:mod:`rlpost.rollout.episodes.harness_process`). Its key opens its own session and no other;
the loopback server's keys stay with the trainer. It returns its final answer, which the
reward terms judge, a number added to their reward, or nothing (the last request's text is
the answer); a command prints its answer as its last stdout line, or a last line
``reward: <number>`` for a reward (a number alone is an answer). A reward that is not finite
or lies outside ``reward.score_range`` makes the sample invalid (the reward worker counts
it). A harness that raises, exits non-zero or runs past
``timeout_s`` is counted and its session dropped; one stopped by a session bound is kept as
truncated. Every session is closed when its harness ends.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rlpost.rng import derive
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote_sessions import RemoteSessions
from rlpost.rollout.episodes.harness_process import HarnessProcess, harness_env
from rlpost.rollout.serve.sessions import Session, SessionBounds, session_samples
from rlpost.types import Completion, Prompt

GRACE_S = 5.0  # past the session's wall bound, a harness still running is hung
REWARD_LINE = re.compile(r"reward:\s*(\S+)")  # a command's last line that is its reward


@dataclass(frozen=True)
class HarnessSettings:
    """How to run the agent and bound its sessions (``agent.harness``)."""

    entry: Callable | None = None
    command: tuple[str, ...] = ()
    env: tuple[str, ...] = ()  # the trainer's variables a command also gets (by name)
    bounds: SessionBounds = field(default_factory=SessionBounds)
    workers: int = 8
    chat_template: str | None = None  # served in place of the tokenizer's (None: its own)
    tool_parser: str = "hermes"
    grace_s: float = GRACE_S
    own_user: bool = True  # a command under a uid of its own when the trainer is root

    @property
    def timeout_s(self) -> float:
        return self.bounds.max_seconds + self.grace_s


@dataclass
class HarnessStats:
    """Counts over the sessions of one ``generate`` call."""

    sessions: int = 0
    failed: int = 0
    timed_out: int = 0
    truncated: int = 0
    requests: int = 0
    rows: int = 0
    tool_calls: int = 0
    tokens: int = 0
    output_dropped: int = 0  # bytes of commands' output past the kept tails
    error: str = ""  # the first failed session's reason

    def metrics(self) -> dict[str, float]:
        s, kept = max(self.sessions, 1), max(self.sessions - self.failed - self.timed_out, 1)
        return {
            "harness_sessions": float(self.sessions),
            "harness_failed": float(self.failed),
            "harness_timed_out": float(self.timed_out),
            "harness_dropped_frac": (self.failed + self.timed_out) / s,
            "harness_bound_frac": self.truncated / s,
            "harness_segments_mean": self.rows / kept,
            "agent_turns_mean": self.requests / kept,
            "agent_tool_calls_mean": self.tool_calls / kept,
            "agent_episode_tokens_mean": self.tokens / kept,
            "harness_output_dropped_bytes": float(self.output_dropped),
        }


@dataclass
class _Job:
    prompt: Prompt
    group: int
    bounds: SessionBounds
    sampling: SamplingParams
    seed: int | None
    session: Session | None = None  # opened when the job starts
    closed: Session | None = None  # the record its closing returned
    lost: str | None = None  # why its server could not close it
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the timeout vs the start
    result: Any = None
    error: str | None = None
    timed_out: bool = False
    deadline: float = 0.0
    process: HarnessProcess | None = None
    dropped: int = 0


class LoopbackServer:
    """The OpenAI server over a started scheduler, on 127.0.0.1 in a daemon thread, with
    random keys of its own that no agent gets: an agent reaches only its session."""

    def __init__(self, scheduler, tokenizer, name: str, tool_parser: str) -> None:
        import uvicorn

        from rlpost.rollout.serve.guard import GuardSettings
        from rlpost.rollout.serve.openai_params import ServerSettings
        from rlpost.rollout.serve.server import create_app

        settings = ServerSettings(
            name,
            max_tokens_limit=1 << 20,
            max_model_len=scheduler.max_model_len,
            tool_parser=tool_parser,
        )
        keys = GuardSettings(secrets.token_urlsafe(32), secrets.token_urlsafe(32))
        self.app = create_app(scheduler, tokenizer, settings, keys)
        self.sessions = self.app.state.sessions
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the loopback OpenAI server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


class AgentRunner:
    """Runs the harness once per sample; the rollout worker's ``agent`` in harness mode."""

    variable_groups = True  # dropped sessions and segments: a prompt's rows vary in number

    def __init__(
        self,
        engine,
        tokenizer,
        settings: HarnessSettings,
        name: str = "policy",
        remote: RemoteSessions | None = None,
    ) -> None:
        """``remote``: sessions live on rollout servers (``rollout.engine=remote``); None: on a
        loopback server over ``engine``'s scheduler."""
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.server: LoopbackServer | None = None
        if remote is not None:
            self.sessions = remote
        else:
            scheduler = engine.scheduler  # the continuous engine's (the rule table sees to it)
            served = tokenizer
            if settings.chat_template is not None:  # a copy: the training tokenizer is untouched
                served = copy.copy(tokenizer)
                served.chat_template = settings.chat_template
            self.server = LoopbackServer(scheduler, served, name, settings.tool_parser)
            self.sessions = self.server.sessions
        self.last_stats = HarnessStats()
        self.last_sessions: list[Session] = []  # the latest call's sessions, as recorded

    @property
    def version(self) -> int:
        return self.engine.version

    def base_url(self, session: Session) -> str:
        if self.server is None:
            return self.sessions.base_url(session.id)
        return f"{self.server.url}/sessions/{session.id}/v1"

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        group_offset: int = 0,
        prompts: list[Prompt] | None = None,
    ) -> list[Completion]:
        """Rows for ``n`` sessions of each prompt (``group`` = the prompt's index)."""
        prompts = prompts or [Prompt(self.tokenizer.decode(ids)) for ids in prompt_ids]
        sampling = replace(params, stop_token_ids=())
        bounds = replace(self.settings.bounds, max_tokens=params.max_tokens)
        jobs = []
        for i, p in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else derive(params.seed, "session", i * n + j)
                jobs.append(_Job(p, group_offset + i, bounds, sampling, seed))
        self._run_all(jobs)
        return self._collect(jobs)

    def _run_all(self, jobs: list[_Job]) -> None:
        """Every job, ``workers`` at a time; one past its deadline is abandoned (a command is
        killed with all it started; a hung function's thread is left to finish on its own,
        its session closed)."""
        queue, running, changed = deque(jobs), [], threading.Event()
        while queue or running:
            while queue and len(running) < self.settings.workers:
                job = queue.popleft()
                job.deadline = time.monotonic() + self.settings.timeout_s
                threading.Thread(target=self._run, args=(job, changed), daemon=True).start()
                running.append(job)
            changed.wait(0.05)
            changed.clear()
            now = time.monotonic()
            for job in list(running):
                if job.done.is_set():
                    running.remove(job)
                elif now > job.deadline:
                    with job.lock:
                        job.timed_out = True
                        session, process = job.session, job.process
                    if session is not None:
                        self._close(session.id)
                    if process is not None:
                        process.kill()
                    running.remove(job)

    def _run(self, job: _Job, changed: threading.Event) -> None:
        try:
            session = self.sessions.open(job.bounds, job.sampling, seed=job.seed)
            with job.lock:
                job.session = session
            if not job.timed_out:
                command = self.settings.entry is None
                job.result = self._command(job) if command else self._call(job)
        except Exception as exc:  # the harness's failure: counted, the session dropped
            job.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            if job.session is not None:  # closed when its harness ends: nothing waits on it
                closed, lost = self._close(job.session.id)
                if closed is not None or lost is not None:  # not closed already (timed out)
                    job.closed, job.lost = closed, lost
            job.done.set()
            changed.set()

    def _call(self, job: _Job):
        fn = self.settings.entry
        info = {"api_key": job.session.key, "session_id": job.session.id}
        info["metadata"] = job.prompt.metadata
        try:
            accepted = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            accepted = {}
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        kwargs = {k: v for k, v in info.items() if takes_all or k in accepted}
        return fn(job.prompt.text, self.base_url(job.session), **kwargs)

    def _command(self, job: _Job):
        env = harness_env(self.base_url(job.session), job.session.key, self.settings.env)
        with job.lock:
            if job.timed_out:
                return None
            job.process = HarnessProcess(self.settings.command, env, self.settings.own_user)
        done = job.process.run(job.prompt.text)
        job.dropped = done.dropped
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or [""])[-1][:200]
            job.error = f"harness command exited {done.returncode}: {tail}"
            return None
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        if not lines:
            return None
        last = lines[-1].strip()
        if (reward := REWARD_LINE.fullmatch(last)) is None:
            return last
        try:
            return float(reward.group(1))
        except ValueError:  # not a number: an invalid reward, never an answer
            return math.nan

    def _collect(self, jobs: list[_Job]) -> list[Completion]:
        s = self.last_stats = HarnessStats(sessions=len(jobs))
        rows: list[Completion] = []
        self.last_sessions = []
        for job in jobs:
            s.output_dropped += job.dropped
            session, lost = job.closed or job.session, job.lost
            if session is not None:
                self.last_sessions.append(session)
            if job.timed_out:
                s.timed_out += 1
                continue
            truncated = session is not None and session.bound_hit is not None
            if session is None or (job.error and not truncated) or not session.requests or lost:
                s.failed += 1
                none = "the harness sent no request" if session else "the session did not open"
                s.error = s.error or lost or job.error or none
                continue
            result = None if job.error is not None else job.result
            reward = float(result) if isinstance(result, int | float) else 0.0
            answer = result if isinstance(result, str) else None
            out = session_samples(session, job.group, answer)
            for c in out:
                if truncated:
                    c.finish_reason = "length"
                    c.episode.budget = session.bound_hit
                last = [t for t in c.episode.turns if t.role == "policy"][-1]
                last.reward = reward
            s.truncated += truncated
            s.requests += len(session.requests)
            s.tool_calls += sum(r.tool_calls for r in session.requests)
            s.tokens += session.tokens
            s.rows += len(out)
            rows += out
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {}  # sessions never outlive a step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def _close(self, sid: str) -> tuple[Session | None, str | None]:
        """(the closed session, None: closed already; the line saying why its remote server
        could not close it: the session is lost, or None)."""
        try:
            return self.sessions.close(sid), None
        except RuntimeError as exc:
            return None, (str(exc).splitlines() or [type(exc).__name__])[0]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        else:
            self.sessions.close_all()
