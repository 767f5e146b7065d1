"""``rlpost serve``: the rollout engine as an OpenAI-compatible HTTP service.

    rlpost serve [--model DIR] [--port 8000] [--max-batch 64] [--max-tokens-limit 512] [--max-n 64]

``/v1/completions`` and ``/v1/chat/completions`` follow the OpenAI API (n,
temperature, top_p, top_k, max_tokens, stop, logprobs, seed; a prompt is text
or token ids) and add what RL needs: each choice carries ``token_ids`` (the
sampled ids), the logprob of every sampled token, the ``policy_version`` of
its first token and every version it spans; each response carries the
server's ``policy_version``. ``POST /v1/weights`` swaps weights between two
decode steps (a safetensors directory path, or safetensors bytes streamed in
the body with ``?version=N``). ``/health`` reports the scheduler's counters,
``/metrics`` the ``rl_*`` rollout metrics in Prometheus text. Requests share
decode steps through :class:`~rlpost.rollout.scheduler.Scheduler`. Bad input is
a 4xx with a one-line reason in the OpenAI error envelope; a client that
disconnects frees its slots; no request can stop the server (docs/rollout.md).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from rlpost.observe import Recorder
from rlpost.rollout.client import decode_weights, read_weights
from rlpost.rollout.prefix_cache import PrefixCache
from rlpost.rollout.protocol import SamplingParams
from rlpost.rollout.scheduler import GenerationRequest, SampleOutput, Scheduler
from rlpost.rollout.sync_routes import router as sync_router

MAX_TOP_LOGPROBS = 20
MAX_STOP_TEXTS = 16
POLL_SECONDS = 0.1  # how often a waiting request checks that its client is still there
UNSUPPORTED = {"stream": True, "echo": True, "suffix": None}


class APIError(Exception):
    """A request the server refuses; ``message`` is one line."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(message: str, param: str | None = None) -> dict:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return {"error": error}


@dataclass
class ServerSettings:
    """Limits a request is checked against."""

    model_name: str
    max_tokens_limit: int = 512
    max_n: int = 64
    max_model_len: int | None = None
    weights_timeout_s: float = 600.0


# ---------------------------------------------------------------- parsing


def _field(body: dict, key: str, default, low, high=math.inf, *, integer=False, low_open=False):
    """``body[key]`` checked to be a number (an integer if ``integer``) in range; ``default`` if absent."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"{key} must be {kind}, got {value!r}", key)
    if value < low or (low_open and value == low) or value > high:
        if math.isinf(high):
            bound = f"{'>' if low_open else '>='} {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]"
        raise APIError(400, f"{key}={value} must be {bound}", key)
    return value


def _token_list(value: Any, vocab: int, key: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise APIError(400, f"{key} token ids must be integers", key)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{key} token id {bad[0]} is outside the vocabulary [0, {vocab})", key)
    return list(value)


def parse_prompts(value: Any, tokenizer, add_special_tokens: bool) -> list[list[int]]:
    """The prompt(s) of a completion request as token ids: text, ids, or a list of either."""
    flat_ids = isinstance(value, list) and value and all(isinstance(v, int) for v in value)
    items = [value] if isinstance(value, str) or flat_ids else value
    if not isinstance(items, list) or not items:
        raise APIError(400, "prompt is missing or empty", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"]
        elif isinstance(item, list):
            ids = _token_list(item, len(tokenizer), "prompt")
        else:
            raise APIError(400, "prompt must be text, token ids, or a list of either", "prompt")
        if not ids:
            raise APIError(400, "prompt is empty: it must have at least one token", "prompt")
        prompts.append(ids)
    return prompts


def chat_prompt(messages: Any, tokenizer) -> list[int]:
    """Token ids of a chat: the tokenizer's chat template, or ``role: content`` lines without one."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    turns = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message needs a string role and content", "messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts; only text parts are understood
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise APIError(400, "each message needs a string role and content", "messages")
        turns.append({"role": m["role"], "content": content})
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: "
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise APIError(400, "messages are empty: the prompt has no tokens", "messages")
    return list(ids)


def parse_sampling(body: dict, settings: ServerSettings, tokenizer, *, chat: bool) -> dict:
    """Sampling fields shared by both endpoints -> keyword arguments of GenerationRequest."""
    for key, bad in UNSUPPORTED.items():
        if body.get(key) is not None and (bad is None or body[key] == bad):
            raise APIError(400, f"{key}={body[key]!r} is not supported by this server", key)
    name = settings.model_name
    if body.get("model") not in (None, name):
        raise APIError(
            404, f"model {body['model']!r} does not exist; this server serves {name!r}", "model"
        )
    limit = settings.max_tokens_limit
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_TEXTS
        or not all(isinstance(x, str) for x in stops)
    ):
        raise APIError(
            400, f"stop must be a string or a list of at most {MAX_STOP_TEXTS} strings", "stop"
        )
    top_k = _field(body, "top_k", -1, -1, integer=True)
    params = SamplingParams(
        temperature=float(_field(body, "temperature", 1.0, 0)),
        top_p=float(_field(body, "top_p", 1.0, 0, 1, low_open=True)),
        top_k=-1 if top_k == 0 else top_k,  # vLLM spells "no top-k" as 0 or -1
        max_tokens=_field(body, key, 16, 1, limit, integer=True),
        stop_token_ids=tuple(
            _token_list(body.get("stop_token_ids") or [], len(tokenizer), "stop_token_ids")
        ),
    )
    top_key = "top_logprobs" if chat else "logprobs"
    top = (
        _field(body, top_key, 0, 0, MAX_TOP_LOGPROBS, integer=True)
        if not chat or body.get("logprobs")
        else 0
    )
    return {
        "params": params,
        "n": _field(body, "n", 1, 1, settings.max_n, integer=True),
        "stop_texts": tuple(x for x in stops if x),
        "top_logprobs": top,
        "seed": _field(body, "seed", None, 0, (1 << 62), integer=True),
        "ignore_eos": body.get("ignore_eos") is True,
    }


def check_context(prompts: list[list[int]], max_tokens: int, settings: ServerSettings) -> None:
    limit = settings.max_model_len
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_tokens > limit:
        raise APIError(
            400,
            f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {limit} tokens",
            "max_tokens",
        )


# ------------------------------------------------------------- formatting


def format_choice(index: int, out: SampleOutput, tokenizer, *, chat: bool, logprobs: bool) -> dict:
    """One OpenAI choice plus the RL fields: sampled ``token_ids`` and the policy versions."""
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    text = text[: out.text_end] if out.text_end is not None else text
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = chat_logprobs(out, tokenizer) if logprobs else None
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(out, tokenizer) if logprobs else None
    choice.update(
        finish_reason=out.finish_reason,
        token_ids=out.token_ids,
        policy_version=out.policy_version,
        policy_versions=out.versions,
    )
    return choice


def completion_logprobs(out: SampleOutput, tokenizer) -> dict:
    """The OpenAI completions ``logprobs`` object for one choice."""
    pieces = [tokenizer.decode([t]) for t in out.token_ids]
    tops = None
    if out.top_logprobs is not None:
        tops = [{tokenizer.decode([t]): lp for t, lp in alts} for alts in out.top_logprobs]
    offsets = [0, *accumulate(len(p) for p in pieces)][: len(pieces)]
    return {
        "tokens": pieces,
        "token_logprobs": out.logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(out: SampleOutput, tokenizer) -> dict:
    """The OpenAI chat ``logprobs`` object (``content`` list) for one choice."""

    def entry(token_id: int, logprob: float) -> dict:
        piece = tokenizer.decode([token_id])
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    tops = out.top_logprobs or [[] for _ in out.token_ids]
    content = [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
        for t, lp, alts in zip(out.token_ids, out.logprobs, tops, strict=True)
    ]
    return {"content": content}


class RolloutService:
    """The server's state and handlers; :func:`create_app` routes HTTP to them."""

    def __init__(self, scheduler: Scheduler, tokenizer, settings: ServerSettings) -> None:
        self.scheduler, self.tokenizer, self.settings = scheduler, tokenizer, settings
        self.recorder = Recorder(None)
        self.counts = {"ok": 0, "rejected": 0, "failed": 0, "disconnected": 0}
        # Throughput and utilisation are measured between two /metrics scrapes.
        self.window = (time.monotonic(), 0, 0.0)
        self.rates = {"rollout_tps": 0.0, "rollout_utilization": 0.0}

    async def generate(self, request: Request, prompts: list[list[int]], fields: dict):
        """One scheduler request per prompt -> their outputs; None when the client went away."""
        seed = fields.pop("seed")
        tickets = [
            # A distinct seed per prompt, or every prompt would draw the same random stream.
            self.scheduler.submit(
                GenerationRequest(p, seed=None if seed is None else seed + i, **fields)
            )
            for i, p in enumerate(prompts)
        ]
        futures = [asyncio.wrap_future(t.future) for t in tickets]
        try:
            pending = set(futures)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=POLL_SECONDS)
                if pending and await request.is_disconnected():
                    self.counts["disconnected"] += 1
                    return None
            return [f.result() for f in futures]
        finally:
            for t in tickets:
                if not t.future.done():
                    self.scheduler.cancel(t)

    async def respond(self, request: Request, chat: bool):
        body, tok, settings = await json_body(request), self.tokenizer, self.settings
        fields = parse_sampling(body, settings, tok, chat=chat)
        if chat:
            prompts = [chat_prompt(body.get("messages"), tok)]
        else:
            prompts = parse_prompts(
                body.get("prompt"), tok, body.get("add_special_tokens", True) is True
            )
        check_context(prompts, fields["params"].max_tokens, settings)
        results = await self.generate(request, prompts, fields)
        if results is None:
            return Response(status_code=499)  # nobody is listening
        want = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        choices = [
            format_choice(i * fields["n"] + j, out, tok, chat=chat, logprobs=want)
            for i, outs in enumerate(results)
            for j, out in enumerate(outs)
        ]
        used = sum(len(p) for p in prompts), sum(len(c["token_ids"]) for c in choices)
        self.counts["ok"] += 1
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": settings.model_name,
            "policy_version": min(c["policy_version"] for c in choices),
            "choices": choices,
            "usage": {
                "prompt_tokens": used[0],
                "completion_tokens": used[1],
                "total_tokens": sum(used),
            },
        }

    async def weights(self, request: Request) -> dict:
        if request.headers.get("content-type", "").startswith("application/octet-stream"):
            version = _version(request.query_params.get("version"))
            payload = await request.body()
        else:
            body = await json_body(request)
            version = _version(body.get("version"))
            payload = body.get("path")
            if not isinstance(payload, str) or not payload:
                raise APIError(400, "path must name a safetensors file or directory", "path")
        load = decode_weights if isinstance(payload, bytes) else read_weights
        try:
            tensors = await run_in_threadpool(load, payload)
            seconds = await run_in_threadpool(
                self.scheduler.load_weights,
                tensors.items(),
                version,
                self.settings.weights_timeout_s,
            )
        except (KeyError, ValueError) as exc:
            raise APIError(400, str(exc).strip("'\"")) from None
        self.recorder.record(version, {"sync_seconds": seconds})
        return {
            "policy_version": self.scheduler.version,
            "tensors": len(tensors),
            "seconds": seconds,
        }

    def health(self) -> JSONResponse:
        alive = self.scheduler.alive
        body = {
            "status": "ok" if alive else "scheduler stopped",
            "model": self.settings.model_name,
            **self.scheduler.stats(),
            "http": dict(self.counts),
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


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def create_app(scheduler: Scheduler, tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``scheduler`` (already started)."""
    app = FastAPI(title="rlpost rollout server")
    service = app.state.service = RolloutService(scheduler, tokenizer, settings)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        service.counts["rejected"] += 1
        return JSONResponse(error_body(exc.message, exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        service.counts["failed"] += 1
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        body = error_body(f"internal error: {type(exc).__name__}: {line}")
        body["error"]["type"] = "internal_error"
        return JSONResponse(body, status_code=500)

    async def completions(request: Request):
        return await service.respond(request, chat=False)

    async def chat_completions(request: Request):
        return await service.respond(request, chat=True)

    async def models():
        card = {"id": settings.model_name, "object": "model", "owned_by": "rlpost"}
        return {"object": "list", "data": [{**card, "max_model_len": settings.max_model_len}]}

    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/weights")(service.weights)
    app.include_router(sync_router)
    app.get("/v1/models")(models)
    app.get("/health")(service.health)
    app.get("/metrics")(service.metrics)
    return app


def _version(value: Any) -> int:
    text = str(value) if isinstance(value, int | str) and not isinstance(value, bool) else ""
    if not text.isdigit():
        raise APIError(400, f"version must be an integer >= 0, got {value!r}", "version")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlpost serve", description="Serve a policy over HTTP.")
    add = ap.add_argument
    add("--model", help="HF checkpoint directory (default: the built-in tiny model)")
    add("--served-model-name", help="the 'model' clients send (default: the directory name)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    add("--max-batch", type=int, default=64, help="sequences decoded together")
    add("--max-tokens-limit", type=int, default=512, help="largest max_tokens accepted")
    add("--max-n", type=int, default=64, help="largest n accepted")
    add("--prefix-cache-tokens", type=int, default=65536, help="prefix cache size [tokens]")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return ap


def main(argv: list[str] | None = None) -> int:
    import torch
    import uvicorn

    from rlpost.models.loading import ModelLoadError, load_policy

    args = build_parser().parse_args(argv)
    for flag in ("max_batch", "max_tokens_limit", "max_n"):
        if getattr(args, flag) < 1:
            return _fail(f"--{flag.replace('_', '-')} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_policy(args.model, seed=args.seed)
    except ModelLoadError as exc:
        return _fail(str(exc))
    name = args.served_model_name or (Path(args.model).name if args.model else "rlpost-tiny")
    cache = PrefixCache(max_tokens=args.prefix_cache_tokens)
    options = {"max_batch": args.max_batch, "prefix_cache": cache, "seed": args.seed}
    scheduler = Scheduler(model, tokenizer, **options)
    settings = ServerSettings(name, args.max_tokens_limit, args.max_n, scheduler.max_model_len)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        return _fail(f"cannot bind {args.host}:{args.port} ({exc.strerror})")
    sock.listen(256)
    scheduler.start()
    port = sock.getsockname()[1]
    print(f"rlpost serve: listening on http://{args.host}:{port} model={name}", flush=True)
    app = create_app(scheduler, tokenizer, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.stop()
    return 0


def _fail(message: str) -> int:
    print(f"rlpost serve: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
