"""``rlpost serve``: the rollout engine as an OpenAI-compatible HTTP service.

    rlpost serve [--model DIR] [--port 8000] [--api-key K --admin-key A] ...

``/v1/completions`` and ``/v1/chat/completions`` follow the OpenAI API (fields:
:mod:`~rlpost.rollout.serve.openai_params`, which refuses by name what it does not implement)
and add what RL needs: each choice carries its sampled ``token_ids``, their logprobs, the
``policy_version`` of its first token and every version it spans. ``stream=true`` sends one
event per sampled token with its id, logprob and version. Chat ``tools`` are rendered by the
chat template and read back into ``tool_calls`` (:mod:`~rlpost.rollout.serve.tool_calls`).
Weights arrive over ``/v1/sync`` (the ``http`` channel,
:mod:`~rlpost.rollout.serve.sync_routes`) between two decode steps. ``/health`` reports
the scheduler's counters, ``/metrics`` the ``rl_*`` rollout metrics.

Keys, body and pending limits: :class:`~rlpost.rollout.serve.guard.Guard`; slow heads:
:func:`~rlpost.rollout.serve.net.guarded_h11`. Bad input is a 4xx with a one-line reason in
the OpenAI error envelope; a client that disconnects frees its slots; no request can stop the
server (docs/rollout.md, docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from rlpost.errors import typed_line
from rlpost.observe import Recorder
from rlpost.rollout.engines.backlog import Backlog, backlog_limit
from rlpost.rollout.engines.prefix_cache import PrefixCache
from rlpost.rollout.engines.protocol import prompt_seeds
from rlpost.rollout.engines.scheduler import GenerationRequest, Scheduler, Ticket
from rlpost.rollout.serve.guard import (
    MIB,
    Guard,
    GuardSettings,
    PendingBudget,
)
from rlpost.rollout.serve.net import WRITE_TIMEOUTS, bind_refusal, guarded_h11, is_loopback
from rlpost.rollout.serve.openai_format import ChoiceStream, format_choice
from rlpost.rollout.serve.openai_params import (
    APIError,
    ServerSettings,
    check_context,
    check_work,
    error_body,
    parse_json_object,
    parse_prompts,
    parse_sampling,
)
from rlpost.rollout.serve.score_routes import router as score_router
from rlpost.rollout.serve.sessions import SessionStore, add_session_routes
from rlpost.rollout.serve.sync_routes import router as sync_router
from rlpost.rollout.serve.tool_calls import (
    ToolRequest,
    ToolStream,
    chat_prompt,
    parse_tools,
    read_calls,
)
from rlpost.rollout.serve.tool_parsers import TOOL_PARSERS, tool_format

POLL_SECONDS = 0.1  # how often a waiting request checks that its client is still there


@dataclass
class Plan:
    """One parsed, tokenised, checked generation request."""

    prompts: list[list[int]]
    fields: dict  # GenerationRequest keyword arguments, plus n and seed
    head: dict  # id, created, model
    chat: bool
    logprobs: bool
    stream: bool
    usage: bool
    sequences: int  # prompts x n
    tools: ToolRequest | None = None  # chat with tools whose calls are read from the output


class ReleasingStream(StreamingResponse):
    """A streamed response that closes its events and calls ``release`` however it ends
    (finished, client gone, connection cut for a stalled reader)."""

    def __init__(self, events, release, **kwargs) -> None:
        super().__init__(events, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # its finally cancels the tickets
            finally:
                self.release()


class RolloutService:
    """The server's state and handlers; :func:`create_app` routes HTTP to them."""

    def __init__(self, scheduler: Scheduler, tokenizer, settings: ServerSettings) -> None:
        self.scheduler, self.tokenizer, self.settings = scheduler, tokenizer, settings
        self.recorder = Recorder(None)
        # fell_behind: streams stopped because their client did not read
        kinds = ("ok", "rejected", "failed", "disconnected", "timed_out", "fell_behind")
        self.counts = dict.fromkeys(kinds, 0)
        self.guard: dict[str, int] = {"pending": 0}  # pending sequences, refused_<status>
        self.budget = PendingBudget(GuardSettings().max_pending, self.guard)
        # Throughput and utilisation are measured between two /metrics scrapes.
        self.window = (time.monotonic(), 0, 0.0)
        self.rates = {"rollout_tps": 0.0, "rollout_utilization": 0.0}
        # The run id of the weights served (SessionMeta.run_id of the last /v1/sync commit;
        # "" for the weights the server started with).
        self.weights_run_id = ""
        self.tool_stats = {"tool_calls": 0, "tool_parse_failures": 0}

    def submit(self, prompts: list[list[int]], fields: dict, on_token=None) -> list[Ticket]:
        """One scheduler request per prompt, joining the batch together.

        ``on_token(prompt_index, event)`` observes every sampled token (streaming)."""
        fields = dict(fields)
        seeds = prompt_seeds(fields.pop("seed"), len(prompts))
        requests = [
            GenerationRequest(
                p, seed=seeds[i], on_token=on_token and partial(on_token, i), **fields
            )
            for i, p in enumerate(prompts)
        ]
        return self.scheduler.submit_all(requests)

    def cancel(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            if not t.future.done():
                self.scheduler.cancel(t)

    def fell_behind(self, tickets: list[Ticket]) -> None:
        """A stream's client stopped reading: its samples leave the batch (counted)."""
        self.counts["fell_behind"] += 1
        self.cancel(tickets)

    async def generate(self, request: Request, prompts: list[list[int]], fields: dict):
        """The outputs of every prompt; None when the client went away."""
        tickets = self.submit(prompts, fields)
        futures = [asyncio.wrap_future(t.future) for t in tickets]
        try:
            return [f.result() for f in futures] if await self.wait(request, futures) else None
        finally:
            self.cancel(tickets)

    async def wait(self, request: Request, futures: list) -> bool:
        """Until ``futures`` are done (True), or the client went away (False); a 504 past the
        request timeout."""
        deadline, pending = time.monotonic() + self.settings.request_timeout_s, set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=POLL_SECONDS)
            if pending and await request.is_disconnected():
                self.counts["disconnected"] += 1
                return False
            if pending and time.monotonic() > deadline:
                self.counts["timed_out"] += 1
                raise APIError(504, self.timeout_line())
        return True

    def timeout_line(self) -> str:
        return f"the request ran past the server's --request-timeout of {self.settings.request_timeout_s} s"

    def plan(self, raw: bytes, chat: bool) -> Plan:
        """Parse, tokenise and check one request (on a worker thread: it may be megabytes)."""
        body, tok, settings = parse_json_object(raw), self.tokenizer, self.settings
        fields = parse_sampling(body, settings, tok, chat=chat)
        tools = parse_tools(body, tool_format(settings.tool_parser)) if chat else None
        if chat:
            prompts = [chat_prompt(body.get("messages"), tok, tools, settings.model_name)]
        else:
            special = body.get("add_special_tokens", True) is True
            prompts = parse_prompts(body.get("prompt"), tok, special, settings.max_prompts)
        check_context(prompts, fields["params"].max_tokens, settings)
        sequences = check_work(prompts, fields, settings)
        kind = "chatcmpl" if chat else "cmpl"
        head = {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time())}
        return Plan(
            prompts,
            fields,
            {**head, "model": settings.model_name},
            chat=chat,
            logprobs=bool(body.get("logprobs")) if chat else body.get("logprobs") is not None,
            stream=body.get("stream") is True,
            usage=bool((body.get("stream_options") or {}).get("include_usage")),
            sequences=sequences,
            tools=tools if tools is not None and tools.parses else None,
        )

    async def respond(self, request: Request, chat: bool):
        plan = await run_in_threadpool(self.plan, await request.body(), chat)
        if not plan.stream:
            return await self.answer(request, plan)
        self.budget.take(plan.sequences)  # 429 when the server is full
        release = partial(self.budget.release, plan.sequences)
        return ReleasingStream(self.stream(plan), release, media_type="text/event-stream")

    async def answer(self, request: Request, plan: Plan, record=None) -> Response:
        """The whole response to a planned request; ``record(results, content)`` runs before
        it counts as answered (a session's record; it may still refuse)."""
        self.budget.take(plan.sequences)  # 429 when the server is full
        try:
            results = await self.generate(request, plan.prompts, plan.fields)
            if results is None:
                return Response(status_code=499)  # nobody is listening
            content = await run_in_threadpool(self.whole_response, plan, results)
        finally:
            self.budget.release(plan.sequences)
        if record is not None:
            record(results, content)
        self.counts["ok"] += 1
        return Response(content, media_type="application/json")

    def whole_response(self, plan: Plan, results: list) -> bytes:
        """The response body of a finished request, serialised (on a worker thread)."""
        n, tok = plan.fields["n"], self.tokenizer
        choices = [
            format_choice(i * n + j, out, tok, chat=plan.chat, logprobs=plan.logprobs)
            for i, outs in enumerate(results)
            for j, out in enumerate(outs)
        ]
        for choice in choices if plan.tools else ():
            read_calls(choice, plan.tools, self.tool_stats)
        body = {
            **plan.head,
            "object": "chat.completion" if plan.chat else "text_completion",
            "policy_version": min(c["policy_version"] for c in choices),
            "weights_run_id": self.weights_run_id,
            "choices": choices,
            "usage": _usage(plan.prompts, sum(len(c["token_ids"]) for c in choices)),
        }
        return json.dumps(body).encode()

    async def stream(self, plan: Plan):
        """Server-sent events: one chunk per sampled token, then ``data: [DONE]``.

        A chunk carries the token's id, logprob and policy version; a failure
        mid-stream is an ``error`` event (the status line has gone already).
        Events that arrived together are turned into chunks together, on a
        worker thread (decoding text is the costly part)."""
        n, chat, tickets = plan.fields["n"], plan.chat, []
        streams, calls, backlog = self._open_stream(plan, tickets)
        head = {
            **plan.head,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "weights_run_id": self.weights_run_id,
        }

        def chunks(events: list) -> tuple[str, int]:
            out, finished = [], 0
            for prompt, event in events:
                k = prompt * n + event.index
                choice = streams[k].chunk(event, plan.logprobs)
                choice = calls[k].rewrite(choice) if calls else choice
                finished += event.finish is not None
                out.append(_sse({**head, "policy_version": event.version, "choices": [choice]}))
            return "".join(out), finished

        left, sampled, queue = len(streams), 0, backlog.queue
        deadline = time.monotonic() + self.settings.request_timeout_s
        try:
            while left:
                try:
                    first = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                except TimeoutError:
                    self.counts["timed_out"] += 1
                    yield _sse(error_body(self.timeout_line(), kind="timeout"))
                    return
                events = [first] + [queue.get_nowait() for _ in range(queue.qsize())]
                behind = Backlog.OVERFLOW in events
                events = [e for e in events if e is not Backlog.OVERFLOW]
                tokens = [(p, e) for p, e in events if p is not None]
                failed = [e for p, e in events if p is None and _failure(e) is not None]
                if tokens:
                    text, finished = await run_in_threadpool(chunks, tokens)
                    sampled, left = sampled + len(tokens), left - finished
                    backlog.blocked = True  # until the server has taken the bytes
                    yield text
                    backlog.blocked = False
                stop = self._stream_stop(behind or backlog.overflowed, backlog, failed)
                if stop is not None:
                    yield stop
                    return
            if plan.usage:
                yield _sse({**head, "choices": [], "usage": _usage(plan.prompts, sampled)})
            self.counts["ok"] += 1
            yield "data: [DONE]\n\n"
        finally:  # also when the client goes away or is cut: its samples leave the batch
            self.cancel(tickets)

    def _open_stream(self, plan: Plan, tickets: list) -> tuple[list, list | None, Backlog]:
        """Submit ``plan``'s samples into ``tickets``: per-sample text streams, tool-call
        rewriters, and the backlog the scheduler posts events to."""
        loop = asyncio.get_running_loop()
        holdback = max((len(s) for s in plan.fields["stop_texts"]), default=1) - 1
        count = len(plan.prompts) * plan.fields["n"]
        streams = [ChoiceStream(i, self.tokenizer, holdback, chat=plan.chat) for i in range(count)]
        calls = [ToolStream(plan.tools, self.tool_stats) for _ in streams] if plan.tools else None
        backlog = Backlog(backlog_limit(len(streams)), partial(self.fell_behind, tickets))
        tickets += self.submit(plan.prompts, plan.fields, partial(_post, loop, backlog))
        for t in tickets:
            t.future.add_done_callback(partial(_post, loop, backlog, None))
        return streams, calls, backlog

    def _stream_stop(self, behind: bool, backlog: Backlog, failed: list) -> str | None:
        """The error event that ends a stream: its client fell behind, or a ticket failed."""
        if behind:
            line = f"the client fell {backlog.limit} events behind the stream, which was stopped"
            return _sse(error_body(f"{line}; read a stream as it comes", kind="timeout"))
        if failed:  # a ticket's future: only a failure matters here
            self.counts["failed"] += 1
            line = f"generation failed: {_failure(failed[0])}"
            return _sse(error_body(line, kind="internal_error"))
        return None

    def health(self) -> JSONResponse:
        alive = self.scheduler.alive
        body = {
            "status": "ok" if alive else "scheduler stopped",
            "model": self.settings.model_name,
            "weights_run_id": self.weights_run_id,
            **self.scheduler.stats(),
            "http": {**self.counts, **self.guard, "write_timeouts": WRITE_TIMEOUTS[0]},
            "tool_calls": self.tool_stats,
            "rss_bytes": _rss_bytes(),
            "prefix_cache": self.scheduler.prefix_cache.stats(),
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    def metrics(self) -> Response:
        now, stats = time.monotonic(), self.scheduler.stats()
        then, tokens, busy = self.window
        if now - then > 1e-3:  # two scrapes in a row keep the previous rates
            self.rates = {
                "rollout_tps": (stats["tokens"] - tokens) / (now - then),
                "rollout_utilization": min(1.0, (stats["busy_seconds"] - busy) / (now - then)),
            }
            self.window = (now, stats["tokens"], stats["busy_seconds"])
        self.recorder.record(self.scheduler.version, self.rates)
        return Response(generate_latest(self.recorder.registry), media_type=CONTENT_TYPE_LATEST)


def error_response(status: int, body: dict, headers: dict | None = None) -> Response:
    """An error body as ASCII JSON: a client's lone surrogate, echoed, cannot break it."""
    content = json.dumps(body, ensure_ascii=True).encode()
    return Response(content, status_code=status, headers=headers, media_type="application/json")


def create_app(
    scheduler: Scheduler, tokenizer, settings: ServerSettings, guard: GuardSettings | None = None
) -> FastAPI:
    """The FastAPI app serving ``scheduler`` (already started), behind :class:`Guard`.

    Routers included later (e.g. under ``/v1/sync``) sit behind the same guard."""
    app = FastAPI(title="rlpost rollout server")
    service = app.state.service = RolloutService(scheduler, tokenizer, settings)
    guard = guard or GuardSettings()
    service.budget = PendingBudget(guard.max_pending, service.guard, guard.retry_after_s)
    app.add_middleware(Guard, settings=guard, stats=service.guard)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        service.counts["rejected"] += 1
        headers = dict(exc.headers or {})
        if exc.status in (408, 413):  # the rest of the body is not worth reading
            headers["connection"] = "close"
        return error_response(exc.status, error_body(exc.message, exc.param), headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        service.counts["failed"] += 1
        body = error_body(f"internal error: {typed_line(exc)}", kind="internal_error")
        return error_response(500, body)

    async def completions(request: Request):
        return await service.respond(request, chat=False)

    async def chat_completions(request: Request):
        return await service.respond(request, chat=True)

    async def models():
        card = {"id": settings.model_name, "object": "model", "owned_by": "rlpost"}
        return {"object": "list", "data": [{**card, "max_model_len": settings.max_model_len}]}

    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    app.include_router(sync_router)
    app.include_router(score_router)  # a distillation teacher's prompt logprobs
    app.get("/v1/models")(models)
    app.get("/health")(service.health)
    app.get("/metrics")(service.metrics)
    app.state.sessions = SessionStore(guard.max_sessions)  # outside agents' records (sessions.py)
    add_session_routes(app, service, app.state.sessions)
    return app


def _rss_bytes() -> int:
    """Resident memory of this process (Linux; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _usage(prompts: list[list[int]], completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in prompts)
    total = prompt + completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": total}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _failure(future) -> BaseException | None:
    return None if future.cancelled() else future.exception()


def _post(loop: asyncio.AbstractEventLoop, backlog: Backlog, prompt, event) -> None:
    """Hand an event from the scheduler thread to the stream's backlog; never raises there."""
    # RuntimeError: the loop has closed, so nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(backlog.put, (prompt, event))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlpost serve", description="Serve a policy over HTTP.")
    add = ap.add_argument
    add("--model", help="HF checkpoint directory or .gguf file (default: the built-in tiny model)")
    add("--served-model-name", help="the 'model' clients send (default: the directory name)")
    add("--host", default="127.0.0.1", help="a non-loopback address needs both keys")
    add("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    add("--max-batch", type=int, default=64, help="sequences decoded together")
    add(
        "--max-request-batch",
        type=int,
        default=None,
        help="sequences of one request decoded together while another runs or waits "
        "(default: an eighth of --max-batch, at least 2)",
    )
    add("--max-tokens-limit", type=int, default=512, help="largest max_tokens accepted")
    add("--max-n", type=int, default=64, help="largest n accepted")
    add("--max-prompts", type=int, default=1024, help="most prompts in one completions request")
    add("--prefix-cache-tokens", type=int, default=65536, help="prefix cache size [tokens]")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add("--tool-parser", default="hermes", choices=sorted(TOOL_PARSERS), help="call format")
    sec = ap.add_argument_group("keys (prefer the environment: flags show in ps)")
    add = sec.add_argument
    add("--api-key", help="Bearer key for the OpenAI endpoints (env RLPOST_API_KEY)")
    add("--admin-key", help="Bearer key for /v1/sync and the control routes (env RLPOST_ADMIN_KEY)")
    add("--insecure", action="store_true", help="bind a non-loopback address without both keys")
    lim = ap.add_argument_group("limits")
    for flag, kind, default, what in LIMIT_FLAGS:
        shown = "" if default is None else f" (default {default})"
        lim.add_argument(flag, type=kind, default=default, help=what + shown)
    return ap


LIMIT_FLAGS = [
    ("--max-body-mb", float, 16.0, "largest request body [MiB]; 413 beyond"),
    ("--max-weights-mb", float, 65536.0, "largest control request body (a /v1/sync bucket) [MiB]; 413 beyond"),
    ("--max-connections", int, 1024, "open connections; 503 beyond (uvicorn's limit)"),
    ("--max-pending", int, 4096, "sequences (prompts x n) running or queued; 429 beyond"),
    ("--max-request-sequences", int, None,
     "prompts x n of one request; 400 beyond (default: 1024, at most --max-pending)"),
    ("--max-score-entries", int, 1 << 32,
     "prompts x longest prompt x vocabulary of one /v1/prompt_logprobs request; 400 beyond"),
    ("--max-sessions", int, 1024, "recorded agent sessions open at once; 429 beyond"),
    ("--max-request-tokens", int, 1 << 21,
     "prompts x n x max_tokens x (1 + top logprobs) of one request; 400 beyond"),
    ("--request-timeout", float, 600.0, "seconds a request may generate; 504 beyond"),
    ("--body-timeout", float, 30.0, "seconds to receive a generation request's body; 408 beyond"),
    ("--write-timeout", float, 30.0, "seconds a response may not drain; the connection is cut"),
    ("--header-timeout", float, 10.0, "seconds to receive a request's headers; closed beyond"),
    ("--keep-alive-timeout", float, 5.0, "seconds an idle connection is kept"),
]  # fmt: skip


def _checked(args: argparse.Namespace) -> str | None:
    """The one-line reason the flags cannot run, or None; fills keys from the environment."""
    args.api_key = args.api_key or os.environ.get("RLPOST_API_KEY") or None
    args.admin_key = args.admin_key or os.environ.get("RLPOST_ADMIN_KEY") or None
    if args.max_request_sequences is None:  # one limit set alone never contradicts the other
        args.max_request_sequences = min(1024, max(args.max_pending, 1))
    for flag in (
        "max_batch",
        "max_tokens_limit",
        "max_n",
        "max_prompts",
        "max_connections",
        "max_pending",
        "max_request_sequences",
        "max_request_tokens",
        "max_score_entries",
        "max_sessions",
    ):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1"
    if args.max_request_batch is not None and args.max_request_batch < 1:
        return "--max-request-batch must be >= 1"
    for flag in (
        "max_body_mb",
        "max_weights_mb",
        "request_timeout",
        "header_timeout",
        "body_timeout",
        "write_timeout",
    ):
        if not getattr(args, flag) > 0:
            return f"--{flag.replace('_', '-')} must be > 0"
    if args.max_request_sequences > args.max_pending:  # such a request could never run
        return "--max-request-sequences must be <= --max-pending"
    return bind_refusal(args.host, args.api_key, args.admin_key, args.insecure)


def main(argv: list[str] | None = None, routers: dict | None = None) -> int:
    """``rlpost serve``; ``routers`` maps a path prefix to an extra APIRouter to mount."""
    import torch

    from rlpost.models.loading import ModelLoadError, load_policy

    args = build_parser().parse_args(argv)
    problem = _checked(args)  # before the model loads: a refused start is instant
    if problem is not None:
        return _fail(problem)
    if not is_loopback(args.host) and not (args.api_key and args.admin_key):
        print(
            f"rlpost serve: warning: --insecure: {args.host} is served without both keys; "
            "anyone who reaches it can generate and replace the weights",
            file=sys.stderr,
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_policy(args.model, seed=args.seed)
    except ModelLoadError as exc:
        return _fail(str(exc))
    name = args.served_model_name or (Path(args.model).name if args.model else "rlpost-tiny")
    cache = PrefixCache(max_tokens=args.prefix_cache_tokens)
    options = {"max_batch": args.max_batch, "prefix_cache": cache, "seed": args.seed}
    options["max_request_batch"] = args.max_request_batch
    scheduler = Scheduler(model, tokenizer, **options)
    settings = ServerSettings(
        name,
        args.max_tokens_limit,
        args.max_n,
        scheduler.max_model_len,
        request_timeout_s=args.request_timeout,
        max_prompts=args.max_prompts,
        max_request_sequences=args.max_request_sequences,
        max_request_tokens=args.max_request_tokens,
        tool_parser=args.tool_parser,
        max_score_entries=args.max_score_entries,
    )
    guard = GuardSettings(
        args.api_key,
        args.admin_key,
        int(args.max_body_mb * MIB),
        int(args.max_weights_mb * MIB),
        args.max_pending,
        args.request_timeout,
        args.body_timeout,
        max_sessions=args.max_sessions,
    )
    app = create_app(scheduler, tokenizer, settings, guard)
    for prefix, router in (routers or {}).items():
        app.include_router(router, prefix=prefix)
    return _serve(app, scheduler, args, name)


def _serve(app: FastAPI, scheduler: Scheduler, args: argparse.Namespace, name: str) -> int:
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        return _fail(f"cannot bind {args.host}:{args.port} ({exc.strerror})")
    sock.listen(min(args.max_connections, 4096))
    scheduler.start()
    port = sock.getsockname()[1]
    print(f"rlpost serve: listening on http://{args.host}:{port} model={name}", flush=True)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        http=guarded_h11(args.header_timeout, args.write_timeout),
        limit_concurrency=args.max_connections,
        timeout_keep_alive=args.keep_alive_timeout,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        scheduler.stop()
    return 0


def _fail(message: str) -> int:
    print(f"rlpost serve: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
