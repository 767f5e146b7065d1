"""Recorded sessions on the OpenAI server: what an outside agent's requests sampled.

A request under ``/sessions/<id>/v1/...`` is recorded in session ``<id>`` (prompt ids, sampled
ids, logprobs, versions), which becomes training samples as recorded (:func:`session_samples`).
A session samples at the run's parameters whatever the agent asks, since the trainer recomputes
that distribution. Requests, tokens and wall time are bounded, in-flight requests reserving
their share; a request past a bound, with ``n`` > 1 or ``stream=true`` is a 400, an unknown
session a 404. Every request carries its session's random key (``Authorization: Bearer``).
A store holds at most ``max_open`` sessions (429) and reaps those ``reap_after_s`` past their
wall bound.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.serve.guard import bearer_token, key_digest, key_matches
from rlpost.rollout.serve.openai_params import APIError, parse_json_object
from rlpost.types import Completion, Episode, Turn


@dataclass(frozen=True)
class SessionBounds:
    """What one session may use: requests, sampled tokens (all requests together), seconds."""

    max_requests: int = 8
    max_tokens: int = 512
    max_seconds: float = 120.0


@dataclass
class Request:
    """One recorded request: the context the model saw and what it sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    text: str = ""
    tool_calls: int = 0


@dataclass
class Session:
    id: str
    bounds: SessionBounds
    sampling: SamplingParams
    requests: list[Request] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    seed: int | None = None
    closed: bool = False
    bound_hit: str | None = None  # the bound a refused request ran into
    key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    reserved_requests: int = 0  # admitted, still generating
    reserved_tokens: int = 0  # the max_tokens those were granted
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    def accepts(self, token: str | None) -> bool:
        """``token`` is this session's key (compared as digests, in constant time)."""
        return key_matches(token, key_digest(self.key))

    def settle(self, granted: int, request: Request | None = None) -> None:
        """End an admitted request: return its reservation and record ``request`` (a 404 when
        the session closed meanwhile)."""
        with self.lock:
            self.reserved_requests -= 1
            self.reserved_tokens -= granted
            if request is None:
                return
            if self.closed:
                raise APIError(404, f"session {self.id[:64]!r} closed during the request")
            self.requests.append(request)

    def expired(self, now: float, after_s: float) -> bool:
        return now - self.started > self.bounds.max_seconds + after_s


MAX_OPEN = 1024
REAP_AFTER_S = 60.0  # past its wall bound, a session nobody closed is abandoned


class SessionStore:
    """The open sessions of one server (thread-safe: the runner opens and closes them from
    its threads while the server's event loop records into them)."""

    def __init__(self, max_open: int = MAX_OPEN, reap_after_s: float = REAP_AFTER_S) -> None:
        self.max_open, self.reap_after_s = max_open, reap_after_s
        self.reaped = 0  # sessions closed because nobody closed them in time
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(
        self, bounds: SessionBounds, sampling: SamplingParams, seed: int | None = None
    ) -> Session:
        """A new session (429 when ``max_open`` are open after the expired ones are reaped)."""
        session = Session(uuid.uuid4().hex, bounds, sampling, seed=seed)
        with self._lock:
            now = time.monotonic()
            for old in [s for s in self._open.values() if s.expired(now, self.reap_after_s)]:
                old.closed = True
                del self._open[old.id]
                self.reaped += 1
            if len(self._open) >= self.max_open:
                why = f"{len(self._open)} sessions are open, this server's limit (--max-sessions)"
                raise APIError(
                    429, f"{why}; close one or retry later", headers={"retry-after": "1"}
                )
            self._open[session.id] = session
        return session

    def get(self, sid: str) -> Session:
        with self._lock:
            session = self._open.get(sid)
        if session is None or session.closed:
            raise APIError(404, f"session {sid[:64]!r} is unknown or closed")
        return session

    def close(self, sid: str) -> Session | None:
        """End a session: later requests get a 404, one in flight is not recorded."""
        with self._lock:
            session = self._open.pop(sid, None)
        if session is not None:
            session.closed = True
        return session

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._open)

    def __len__(self) -> int:
        return len(self._open)


def _refuse(session: Session, bound: str, line: str) -> APIError:
    session.bound_hit = bound
    return APIError(400, f"session {session.id}: {line}")


def admit(session: Session, plan, context: int) -> int:
    """Check a planned request against its session's bounds, reserve its share and give it the
    session's sampling; returns the tokens reserved (:meth:`Session.settle` gives them back)."""
    b = session.bounds
    if plan.stream:
        raise APIError(400, f"session {session.id}: stream=true is not recorded; send stream=false")
    if plan.fields["n"] != 1 or len(plan.prompts) != 1:
        raise APIError(400, f"session {session.id}: a session records one choice; n must be 1")
    with session.lock:
        if len(session.requests) + session.reserved_requests >= b.max_requests:
            raise _refuse(session, "requests", f"all {b.max_requests} requests are spent")
        if time.monotonic() - session.started > b.max_seconds:
            raise _refuse(session, "seconds", f"ran past its {b.max_seconds} s")
        left = b.max_tokens - session.tokens - session.reserved_tokens
        room = min(left, context - len(plan.prompts[0]))
        if room < 1:
            raise _refuse(session, "tokens", f"its {b.max_tokens} sampled tokens are spent")
        granted = min(plan.fields["params"].max_tokens, room)
        session.reserved_requests += 1
        session.reserved_tokens += granted
    s = session.sampling
    sampling = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
    plan.fields["params"] = replace(plan.fields["params"], **sampling, max_tokens=granted)
    plan.fields["adjust"] = None  # penalties would make the logprobs another distribution's
    plan.fields["ignore_eos"] = False
    if session.seed is not None:
        plan.fields["seed"] = session.seed + len(session.requests)
    return granted


def unbounded_body(raw: bytes) -> tuple[bytes, int | None]:
    """(the body with max_tokens 1 and no model name, the max_tokens the agent asked for or None): the plan's
    context check then passes, and :func:`admit` fits the real one to what is left."""
    body = parse_json_object(raw)
    body.pop("model", None)  # a harness names its own model: a session serves the policy
    name = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
    asked = body.pop("max_completion_tokens", None)
    asked = body.pop("max_tokens", asked)
    if asked is not None and not (_is(asked, int) and asked >= 1):
        raise APIError(400, f"{name} must be an integer >= 1, got {json.dumps(asked)[:40]}", name)
    body["max_tokens"] = 1
    return json.dumps(body).encode(), asked


def add_session_routes(app, service, store: SessionStore) -> None:
    """``/sessions/{id}/v1/chat/completions`` and ``/sessions/{id}/v1/completions``."""

    async def respond(request: HTTPRequest, sid: str, chat: bool):
        session = store.get(sid)
        if not session.accepts(bearer_token(request.scope["headers"])):
            why = "send Authorization: Bearer <the key the session was opened with>"
            challenge = {"www-authenticate": "Bearer"}
            raise APIError(
                401,
                f"session {sid[:64]!r}: missing or wrong session key ({why})",
                headers=challenge,
            )
        raw, asked = unbounded_body(await request.body())
        try:
            plan = await run_in_threadpool(service.plan, raw, chat)
        except APIError as exc:
            if exc.param == "max_tokens":  # the context is full: the session's token bound
                session.bound_hit = "tokens"
            raise
        limit = service.settings.max_tokens_limit
        plan.fields["params"] = replace(
            plan.fields["params"], max_tokens=min(asked or limit, limit)
        )
        granted = admit(session, plan, service.settings.max_model_len or 1 << 62)
        settled = []

        def record(results: list, content: bytes) -> None:
            out, choice = results[0][0], json.loads(content)["choices"][0]
            message = choice.get("message") or {}
            text = message.get("content") or choice.get("text") or ""
            calls = len(message.get("tool_calls") or [])
            sampled = (list(out.token_ids), list(out.logprobs), list(out.token_versions))
            settled.append(True)
            session.settle(
                granted, Request(list(plan.prompts[0]), *sampled, out.finish_reason, text, calls)
            )

        try:
            return await service.answer(request, plan, record)
        finally:
            if not settled:  # refused, failed or abandoned: its share goes back
                session.settle(granted)

    async def chat(request: HTTPRequest, sid: str):
        return await respond(request, sid, chat=True)

    async def completions(request: HTTPRequest, sid: str):
        return await respond(request, sid, chat=False)

    app.post("/sessions/{sid}/v1/chat/completions")(chat)
    app.post("/sessions/{sid}/v1/completions")(completions)
    add_session_admin_routes(app, store)


def session_record(session: Session) -> dict:
    """A session as JSON: what :func:`session_from_record` reads back on the trainer's side."""
    return {
        "id": session.id,
        "closed": session.closed,
        "bound_hit": session.bound_hit,
        "tokens": session.tokens,
        "requests": [asdict(r) for r in session.requests],
    }


def session_from_record(record: dict, bounds: SessionBounds, sampling: SamplingParams) -> Session:
    """The :class:`Session` a server's record describes (ValueError naming a bad field)."""
    try:
        requests = [
            Request(
                [int(t) for t in r["prompt_ids"]],
                [int(t) for t in r["token_ids"]],
                [float(x) for x in r["logprobs"]],
                [int(v) for v in r["token_versions"]],
                str(r["finish_reason"]),
                text=str(r.get("text") or ""),
                tool_calls=int(r.get("tool_calls") or 0),
            )
            for r in record["requests"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"session record: bad request entry ({type(exc).__name__}: {exc})"
        ) from None
    for r in requests:
        if not len(r.token_ids) == len(r.logprobs) == len(r.token_versions):
            raise ValueError(
                "session record: token_ids, logprobs and token_versions differ in length"
            )
    session = Session(str(record.get("id", "")), bounds, sampling, requests, closed=True)
    session.bound_hit = record.get("bound_hit")
    return session


_BOUNDS = {"max_requests": int, "max_tokens": int, "max_seconds": float}
_SAMPLING = {"temperature": float, "top_p": float, "top_k": int, "seed": int}


def parse_open(raw: bytes) -> tuple[SessionBounds, SamplingParams, int | None]:
    """``POST /v1/sessions``'s body: bounds and the sampling the session must use (400 naming
    the bad field)."""
    body = parse_json_object(raw)
    unknown = sorted(set(body) - set(_BOUNDS) - set(_SAMPLING))
    if unknown:
        raise APIError(400, f"session: unknown field {unknown[0]!r}", unknown[0])
    for name, kind in {**_BOUNDS, **_SAMPLING}.items():
        value = body.get(name)
        if value is not None and not _is(value, kind):
            shown = json.dumps(value)[:40]
            what = "an integer" if kind is int else "a finite number"
            raise APIError(400, f"session: {name} must be {what}, got {shown}", name)
    given = {k: kind(body[k]) for k, kind in _BOUNDS.items() if body.get(k) is not None}
    bounds = SessionBounds(**given)
    for name in _BOUNDS:
        if getattr(bounds, name) <= 0:
            raise APIError(400, f"session: {name} must be > 0", name)
    seed = body.get("seed")
    if seed is not None and not 0 <= seed < 1 << 62:
        raise APIError(400, f"session: seed must be in [0, 2**62), got {seed}", "seed")
    picked = {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    try:
        sampling = SamplingParams(**picked)
    except ValueError as exc:
        raise APIError(400, f"session: {exc}") from None
    return bounds, sampling, seed


def _is(value, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, int | float) and math.isfinite(value)


def add_session_admin_routes(app, store: SessionStore) -> None:
    """``POST`` / ``GET /v1/sessions`` and ``GET`` / ``DELETE /v1/sessions/{id}``, behind the
    admin key, for a trainer elsewhere."""

    async def open_session(request: HTTPRequest):
        bounds, sampling, seed = parse_open(await request.body())
        session = store.open(bounds, sampling, seed=seed)
        return {"id": session.id, "base_path": f"/sessions/{session.id}/v1", "key": session.key}

    async def list_sessions():
        return {"open": store.ids()}

    async def read_session(sid: str):
        return session_record(store.get(sid))

    async def close_session(sid: str):
        session = store.close(sid)
        if session is None:
            raise APIError(404, f"session {sid[:64]!r} is unknown or closed")
        return session_record(session)

    app.post("/v1/sessions")(open_session)
    app.get("/v1/sessions")(list_sessions)
    app.get("/v1/sessions/{sid}")(read_session)
    app.delete("/v1/sessions/{sid}")(close_session)


def _extends(context: list[int], prompt: list[int]) -> bool:
    return len(prompt) >= len(context) and prompt[: len(context)] == context


def segments(requests: list[Request]) -> list[list[Request]]:
    """The requests split where a prompt does not extend the previous request's prompt and
    completion token for token (a template that rewrote the history)."""
    out: list[list[Request]] = []
    for r in requests:
        if out:
            last = out[-1][-1]
            seen = last.prompt_ids + last.token_ids
            if _extends(seen, r.prompt_ids):
                out[-1].append(r)
                continue
        out.append([r])
    return out


def segment_completion(seg: list[Request], group: int, answer: str) -> Completion:
    """One sequence: the first prompt, then each request's sampled tokens (trained) and the
    tokens the next prompt added (masked, logprob 0)."""
    first = seg[0]
    tokens, logprobs, mask, versions, turns = [], [], [], [], []
    for k, r in enumerate(seg):
        if k:
            added = r.prompt_ids[len(first.prompt_ids) + len(tokens) :]
            start = len(tokens)
            tokens += added
            logprobs += [0.0] * len(added)
            mask += [0] * len(added)
            versions += [versions[-1] if versions else 0] * len(added)
            turns.append(Turn("env", start, len(tokens)))
        start = len(tokens)
        tokens += r.token_ids
        logprobs += r.logprobs
        mask += [1] * len(r.token_ids)
        versions += r.token_versions
        tool = "tool_calls" if r.tool_calls else None
        turns.append(Turn("policy", start, len(tokens), tool, text=r.text))
    finish = "length" if seg[-1].finish_reason == "length" else "stop"
    return Completion(
        prompt_ids=list(first.prompt_ids),
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=finish,
        policy_version=versions[0] if versions else 0,
        group=group,
        text=answer,
        loss_mask=mask,
        token_versions=versions,
        episode=Episode(turns, answer),
    )


def session_samples(session: Session, group: int, answer: str | None = None) -> list[Completion]:
    """A finished session's training rows, one per segment, each judged on ``answer`` (the
    agent's final answer; None: the text of the session's last request)."""
    if not session.requests:
        return []
    final = answer if answer is not None else session.requests[-1].text
    return [segment_completion(seg, group, final) for seg in segments(session.requests)]
