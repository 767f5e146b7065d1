"""``rlpost tinker``: the Tinker training API served locally, a face over :mod:`rlpost.api`.

    rlpost tinker --model NAME=PATH [--model PATH ...] [--port 8100] [--state-dir DIR] [--api-key K]
                  [--device cpu|cuda|auto] [--engine hf|vllm]

The official SDK talks to it with ``base_url`` pointed here. Model work answers at once with a
future id; one worker thread runs it, sessions taking turns, and ``/retrieve_future`` answers the
result or "try again". One :class:`rlpost.api.Base` per base model holds the weights; each training
client is a LoRA adapter on it, and samplers run on ``--engine`` (in process, or vLLM with each
saved adapter a LoRA request). Ids are random and every object belongs to the API key that made it
(another key gets a 404). Checkpoints (``tinker://MODEL/weights/NAME``, adapter and AdamW state;
``tinker://MODEL/sampler_weights/NAME``) live under ``--state-dir``. Bad input is a 400 naming the
field; the SDK retries 5xx for minutes, so a request's internal fault answers its future with an
error instead. docs/tinker.md lists the routes and the differences from the hosted service."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlpost.tinker.wire import LOSS_INPUTS, BadInput, read_fwdbwd, types

PROTO = "application/x-protobuf"
# The built-in losses served; Tinker clips the ratio of the clipped ones to [0.8, 1.2].
LOSS_FNS = tuple(LOSS_INPUTS)
LONG_POLL_S = 20.0
SILENT_S = 120.0
KEEP_SAMPLERS = 4
LINGER_S, LINGER_MAX_S = 0.03, 0.5
STEP_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


class Refused(Exception):
    """An HTTP error with a one-line reason: 400 bad input, 401 key, 404 not this key's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _loss(loss_fn: str, config: dict[str, float]) -> tuple[str, dict]:
    """rlpost's registered loss and params for a Tinker ``loss_fn`` (docs/algorithms.md)."""
    clipped = loss_fn in ("ppo", "cispo", "gspo")
    known = {"clip_low_threshold", "clip_high_threshold"} if clipped else set()
    known |= {"beta"} if loss_fn == "dro" else set()
    if loss_fn not in LOSS_FNS:
        why = "; its objective is not published" if loss_fn == "stable_reinforce" else ""
        raise BadInput(f"loss_fn={loss_fn}: not served here{why}; use one of {', '.join(LOSS_FNS)}")
    if bad := sorted(set(config) - known):
        why = f"not a parameter of loss_fn={loss_fn} (takes {sorted(known) or 'none'})"
        raise BadInput(f"loss_fn_config.{bad[0]}: {why}")
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if not 0.0 <= lo <= 1.0 <= hi:
        raise BadInput(f"loss_fn_config: clip thresholds {lo}, {hi}: need 0 <= low <= 1 <= high")
    clip = {"clip_low": 1.0 - lo, "clip_high": hi - 1.0}
    return {
        "cross_entropy": ("reinforce", {}),
        # -A r: a clip range no ratio reaches (r <= e^20 after the log-ratio clamp), no dual clip
        "importance_sampling": (
            "ppo_clip",
            {"clip_low": 1.0, "clip_high": 1e9, "dual_clip": False},
        ),
        "ppo": ("ppo_clip", {**clip, "dual_clip": False}),
        "cispo": ("cispo", clip),
        "gspo": ("gspo", clip),
        "dro": ("dro", {"reg_coef": config.get("beta", 0.05)}),
    }[loss_fn]


@dataclass
class Session:
    id: str
    owner: str
    ended: bool = False
    seen: float = field(default_factory=time.monotonic)


@dataclass
class Model:
    id: str
    owner: str
    session: str
    base: str
    rank: int
    policy: Any = None
    pending: int = 0  # forward_backward calls since the last optim_step (counted at submission)


@dataclass
class Sampler:
    id: str
    owner: str
    base: str
    path: str | None
    session: str = ""
    model: str | None = None  # the training model it was saved from
    engine: Any = None
    clients: int = 0  # join_sampling_session's counter


@dataclass
class Future:
    owner: str
    done: bool = False
    value: Any = None  # a pydantic model, or proto bytes
    error: str | None = None
    category: str = "user"
    wake: Any = None  # set by a long poll waiting on it

    def finish(self) -> None:
        """Done: wake the long poll waiting on it (called from the worker thread)."""
        self.done = True
        if self.wake is not None:
            with contextlib.suppress(RuntimeError):  # the event loop closed (shutting down)
                self.wake()


class Worker:
    """One thread runs every model computation; sessions take turns (round-robin). Work given a
    ``key`` runs together with the work of its lane queued under the same key: ``fn`` takes the
    list of their ``arg`` and returns one value each (the samples of one sampler, one batch)."""

    def __init__(self, live=lambda lane: True) -> None:
        self.live = live  # a lane whose session ended (or went silent) has its work dropped
        self.lanes: dict[str, collections.deque] = {}
        self.turns: collections.deque[str] = collections.deque()
        self.cv = threading.Condition()
        threading.Thread(target=self._run, name="tinker-worker", daemon=True).start()

    def submit(self, lane: str, fut: Future, fn, key=None, arg=None) -> None:
        with self.cv:
            if lane not in self.lanes:
                self.lanes[lane] = collections.deque()
                self.turns.append(lane)
            self.lanes[lane].append((fut, fn, key, arg))
            self.cv.notify()

    def _next(self):
        with self.cv:
            while True:
                for _ in range(len(self.turns)):
                    lane = self.turns[0]
                    self.turns.rotate(-1)
                    if q := self.lanes[lane]:
                        if q[0][2] is not None:
                            self._linger(q, q[0][2])
                        fut, fn, key, arg = q.popleft()
                        same = [job for job in q if key is not None and job[2] == key]
                        for job in same:
                            q.remove(job)
                        return (
                            lane,
                            [fut, *(j[0] for j in same)],
                            fn,
                            key,
                            [arg, *(j[3] for j in same)],
                        )
                self.cv.wait()

    def _linger(self, q: collections.deque, key) -> None:
        """Let a burst of work under ``key`` arrive (the SDK sends a group's samples one
        request each): wait until LINGER_S passes with none new, at most LINGER_MAX_S."""
        deadline, seen = time.monotonic() + LINGER_MAX_S, 0
        while (n := sum(job[2] == key for job in q)) != seen and time.monotonic() < deadline:
            seen = n
            self.cv.wait(LINGER_S)

    def _run(self) -> None:
        while True:
            lane, futs, fn, key, args = self._next()
            if not self.live(lane):
                for fut in futs:
                    fut.error = f"session_id={lane}: the session has ended"
                    fut.finish()
                continue
            try:
                values = fn(args) if key is not None else [fn()]
                for fut, value in zip(futs, values, strict=True):
                    fut.value = value
            except (ValueError, Refused) as exc:  # BadInput and rlpost.api.APIError: bad input
                for fut in futs:
                    fut.error = str(exc)
            except Exception as exc:  # a fault answers its own futures; the worker goes on
                for fut in futs:
                    fut.error, fut.category = f"{type(exc).__name__}: {exc}", "server"
            for fut in futs:
                fut.finish()


class Service:
    """The state behind the routes: bases, sessions, models, samplers and futures."""

    def __init__(self, paths: dict, state_dir: Path, keys: set[str], device: str, engine="hf"):
        self.paths, self.state_dir, self.api_keys, self.device = paths, state_dir, keys, device
        self.engine = engine
        self.bases: dict[str, Any] = {}
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, Future] = {}
        self.worker = Worker(self.alive)

    def alive(self, sid: str) -> bool:
        """False once a session ended or sent no heartbeat for SILENT_S (the SDK sends one
        every 10 s): its client is gone, so its queued work is dropped."""
        s = self.sessions.get(sid)
        if s is not None and time.monotonic() - s.seen > SILENT_S:
            s.ended = True
        return s is None or not s.ended

    # -- identity -----------------------------------------------------------------------
    def owner(self, request: Request) -> str:
        key = request.headers.get("x-api-key", "")
        if self.api_keys and key not in self.api_keys:
            raise Refused(
                401, "X-API-Key: not a key of this service; pass api_key= to ServiceClient"
            )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def _mine(self, table: dict, kind: str, ident: str | None, owner: str):
        obj = table.get(ident or "")
        if obj is None or obj.owner != owner:
            raise Refused(404, f"{kind}={ident}: no such {kind} for this API key")
        return obj

    def session(self, sid: str, owner: str) -> Session:
        s = self._mine(self.sessions, "session_id", sid, owner)
        if s.ended:
            raise BadInput(f"session_id={sid}: the session has ended; create a new ServiceClient")
        s.seen = time.monotonic()
        return s

    def model(self, mid: str, owner: str) -> Model:
        m = self._mine(self.models, "model_id", mid, owner)
        self.session(m.session, owner)
        return m

    # -- futures ------------------------------------------------------------------------
    def submit(self, owner: str, lane: str, fn, model_id: str | None = None, **batch) -> dict:
        fid = secrets.token_hex(12)
        self.futures[fid] = fut = Future(owner)
        self.worker.submit(lane, fut, fn, **batch)
        return {"request_id": fid, "model_id": model_id}

    def retrieve(self, fid: str, owner: str, wait: bool) -> Response:
        """The future's result, or 204 while ``wait`` and the work is not done, else try again."""
        fut = self._mine(self.futures, "request_id", fid, owner)
        if not fut.done and wait:
            return Response(status_code=204)
        if not fut.done:
            # 408, as the hosted service: the SDK polls again without logging a warning
            return JSONResponse({"type": "try_again", "queue_state": "active"}, 408)
        del self.futures[fid]
        if fut.error is not None:
            return JSONResponse({"error": fut.error, "category": fut.category})
        if isinstance(fut.value, bytes):
            return Response(fut.value, media_type=PROTO)
        return JSONResponse(fut.value.model_dump(mode="json", exclude_none=True))

    # -- bases and checkpoints ------------------------------------------------------------
    def base_name(self, name: str) -> str:
        if name in self.paths:
            return name
        matches = [
            k for k, p in self.paths.items() if p and Path(p).resolve() == Path(name).resolve()
        ]
        if not matches:
            raise BadInput(f"base_model={name}: not served here; serving {', '.join(self.paths)}")
        return matches[0]

    def base(self, name: str):
        if name not in self.bases:
            import rlpost.api as api

            path = self.paths[name]
            self.bases[name] = api.Base.load(path, device=self.device, engine=self.engine)
        return self.bases[name]

    def context(self, name: str) -> int | None:
        return getattr(self.bases.get(name), "context", None)

    def ckpt_dir(self, owner: str, path: str, name: str = "path") -> Path:
        """The directory of a ``tinker://MODEL/KIND/NAME`` path this key owns (field ``name``)."""
        if not (d := self.state_dir / owner / _relative(path, name) / "meta.json").is_file():
            raise Refused(404, f"{name}={path}: no such checkpoint for this API key")
        return d.parent


def _relative(path: str, name: str, error: type[Exception] = BadInput) -> Path:
    """``MODEL/KIND/NAME`` of a ``tinker://`` path, which stays inside its key's directory."""
    parts = path.removeprefix("tinker://").split("/")
    if (
        not path.startswith("tinker://")
        or len(parts) != 3
        or parts[1] not in ("weights", "sampler_weights")
        or {parts[0], parts[2]} & {"", ".", ".."}
    ):
        raise error(f"{name}={path}: not a tinker://MODEL/weights/NAME or sampler_weights path")
    return Path(*parts)


def checkpoint_policy(path: str, state_dir: Path):
    """The :class:`rlpost.api.Policy` a ``tinker://`` checkpoint under ``state_dir`` saved (any
    key's), on its base (``rlpost export``); :class:`ModelLoadError` naming what is wrong."""
    import rlpost.api as api
    from rlpost.errors import ModelLoadError
    from rlpost.statefile import load_state

    rel = _relative(path, "source", ModelLoadError)
    found = [d / rel for d in state_dir.glob("*") if (d / rel / "meta.json").is_file()]
    if not found:
        raise ModelLoadError(f"source={path}: no such checkpoint under --state-dir {state_dir}")
    meta = json.loads((found[0] / "meta.json").read_text())
    lora = load_state(found[0] / "state.pt")["lora"]
    policy = api.Base.load(meta.get("base_path", meta["base_model"])).policy(api.LoRA(**lora))
    policy.load_state(found[0], optimizer=False)
    return policy


def _tinker_path(model_id: str, kind: str, name: str | None) -> str:
    name = name or f"{int(time.time() * 1000)}-{secrets.token_hex(3)}"
    if "/" in name or name in ("", ".", ".."):
        raise BadInput(f"path={name}: a checkpoint name has no '/'; use a plain name")
    return f"tinker://{model_id}/{kind}/{name}"


class Ops:
    """The model work behind each route, run by the worker thread, through :mod:`rlpost.api`."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def new_policy(self, base_name: str, lora: types.LoraConfig):
        import rlpost.api as api
        from rlpost.pipeline.memory import machine_mib

        base = self.svc.base(base_name)
        keys = ("rank", "train_attn", "train_mlp", "train_unembed")
        spec = api.LoRA(**{k: getattr(lora, k) for k in keys})
        need, free = base.estimate_bytes(spec) / 2**20, machine_mib()[1]  # free: 0 where unknown
        if free and need > free:
            why = f"a new client needs ~{need:.0f} MiB, {free:.0f} MiB free"
            raise BadInput(f"lora_config.rank={lora.rank}: {why}; close a client or lower the rank")
        return base.policy(lora=spec, seed=lora.seed or 0)

    def create(self, m: Model, lora: types.LoraConfig) -> types.CreateModelResponse:
        m.policy = self.new_policy(m.base, lora)
        return types.CreateModelResponse(model_id=m.id)

    def data(self, req, loss_fn: str) -> list:
        import rlpost.api as api

        out = []
        for row in req.rows:
            x, n = row.inputs, len(row.tokens)
            ones = [1.0] * n
            if loss_fn == "cross_entropy":
                w = x.get("weights")
                w = ones if w is None else w.tolist()
                # -sum(w lp) is REINFORCE with advantages w over the tokens of nonzero weight.
                inputs = {"advantages": w, "logprobs": [0.0] * n}
                weights = [float(v != 0) for v in w]
            else:
                mask = x.get("sequence_ratio_mask" if loss_fn == "gspo" else "mask")
                weights = ones if mask is None else mask.tolist()
                inputs = {
                    "advantages": x["advantages"].tolist(),
                    "logprobs": x["logprobs"].tolist(),
                }
            out.append(api.Datum(row.tokens, x["target_tokens"].tolist(), weights, inputs))
        return out

    def forward_backward(self, m: Model, req) -> bytes:
        from rlpost.tinker.wire import fwdbwd_output

        data = self.data(req, req.loss_fn)
        if req.forward_only:
            lps = m.policy.forward(data)
            return fwdbwd_output({"logprobs": [lp.float().numpy() for lp in lps]}, {})
        name, params = _loss(req.loss_fn, req.config)
        out = m.policy.forward_backward(data, name, agg="token-sum", **params)
        logprobs = [lp.detach().float().numpy() for lp in out.logprobs]
        return fwdbwd_output({"logprobs": logprobs}, {"loss:sum": float(out.loss)})

    def optim_step(self, m: Model, p: types.AdamParams) -> types.OptimStepResponse:
        betas, clip = (p.beta1, p.beta2), p.grad_clip_norm or None
        stats = m.policy.optim_step(
            p.learning_rate, betas=betas, eps=p.eps, grad_clip=clip, weight_decay=p.weight_decay
        )
        return types.OptimStepResponse(metrics={k: float(v) for k, v in stats.items()})

    def save(self, m: Model, path: str, optimizer: bool) -> Path:
        d = self.svc.state_dir / m.owner / path.removeprefix("tinker://").replace("/", os.sep, 2)
        m.policy.save_state(d, optimizer=optimizer)
        meta = dict(base_model=m.base, base_path=self.svc.paths[m.base], rank=m.rank, model_id=m.id)
        meta["time"] = time.time()
        (d / "meta.json").write_text(json.dumps(meta))
        return d

    def load(self, m: Model, d: Path, optimizer: bool, path: str) -> types.LoadWeightsResponse:
        if m.policy is None:
            meta = json.loads((d / "meta.json").read_text())
            m.rank = meta["rank"]
            m.policy = self.new_policy(m.base, types.LoraConfig(rank=meta["rank"]))
        m.policy.load_state(d, optimizer=optimizer)
        return types.LoadWeightsResponse(path=path, model_id=m.id, type="load_weights")

    def sampler_from(self, s: Sampler, d: Path | None, policy=None) -> None:
        """The engine of ``s``: a snapshot of ``policy``, of the adapter saved in ``d``, or the
        base alone. A model keeps its last KEEP_SAMPLERS snapshots (their adapters)."""
        import rlpost.api as api

        if policy is not None:
            s.engine = policy.snapshot()
        elif d is not None:
            meta = json.loads((d / "meta.json").read_text())
            policy = self.new_policy(s.base, types.LoraConfig(rank=meta["rank"]))
            policy.load_state(d, optimizer=False)
            s.engine = policy.snapshot()
            policy.close()
        else:
            s.engine = api.Sampler(self.svc.base(s.base), None)
        live = [x for x in self.svc.samplers.values() if x.model == s.model and x.engine]
        for old in live[: max(0, len(live) - KEEP_SAMPLERS)] if s.model else []:
            gone = old.engine
            gone.close()
            for x in self.svc.samplers.values():
                x.engine = None if x.engine is gone else x.engine

    def sample(self, s: Sampler, reqs: list[types.SampleRequest]) -> list[bytes]:
        """Requests of one sampler with the same params and num_samples: one engine batch,
        in which the requests of one prompt (a group's, sent one by one) share its prefill."""
        import rlpost.api as api
        from rlpost.tinker.wire import sample_output

        if s.engine is None:
            if s.path is None and s.model is not None:
                why = f"its weights were released (a model keeps its last {KEEP_SAMPLERS})"
                raise BadInput(f"sampling_session_id={s.id}: {why}; save them again")
            self.sampler_from(s, self.svc.ckpt_dir(s.owner, s.path) if s.path else None)
        prompts, p = [r.prompt.to_ints() for r in reqs], reqs[0].sampling_params
        stops = [p.stop] if isinstance(p.stop, (str, int)) else list(p.stop or [])
        ids, texts = (tuple(x for x in stops if isinstance(x, t)) for t in (int, str))
        knobs = dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
        params = api.SamplingParams(
            **knobs, max_tokens=p.max_tokens or 16, stop_token_ids=ids, stop_texts=texts
        )
        k, same, got = reqs[0].num_samples, collections.defaultdict(list), {}
        for i, prompt in enumerate(prompts):  # a group's requests: one prompt, one prefill
            same[tuple(prompt)].append(i)
        for count in {len(idx) for idx in same.values()}:
            rows = [(q, idx) for q, idx in same.items() if len(idx) == count]
            done = s.engine.sample([list(q) for q, _ in rows], params, n=count * k)
            for j, (_, idx) in enumerate(rows):
                mine = [(c.token_ids, c.logprobs, c.finish_reason) for c in done if c.group == j]
                got |= {i: mine[r * k : (r + 1) * k] for r, i in enumerate(idx)}
        out = []
        for i, (req, prompt) in enumerate(zip(reqs, prompts, strict=True)):
            prompt_lp = None
            if req.prompt_logprobs:
                lp = (
                    s.engine.forward([api.Datum(prompt[:-1], prompt[1:])])[0]
                    if len(prompt) > 1
                    else []
                )
                prompt_lp = [float("nan")] + [float(v) for v in lp]
            out.append(sample_output(got[i], prompt_lp))
        return out


def _check_step(p: types.AdamParams) -> None:
    for key in STEP_KEYS:
        value = getattr(p, key)
        if not (value == value and abs(value) != float("inf")) or value < 0:
            raise BadInput(f"adam_params.{key}={value}: must be finite and >= 0")
    if not (p.beta1 < 1 and p.beta2 < 1):
        raise BadInput(f"adam_params.beta1={p.beta1}, beta2={p.beta2}: betas must be < 1")


def _parse(cls, body: bytes):
    """``body`` as the SDK's request type ``cls``; :class:`BadInput` naming the first bad field."""
    try:
        return cls.model_validate_json(body or b"{}")
    except Exception as exc:  # pydantic's ValidationError
        errors = getattr(exc, "errors", lambda: [])()
        where = ".".join(str(x) for x in errors[0]["loc"]) if errors else "body"
        msg = errors[0]["msg"] if errors else str(exc)
        raise BadInput(f"{where}: {msg}; see the tinker SDK's {cls.__name__}") from None


class Face:
    """One method per route of ``ROUTES``: ``(request, owner, body) ->`` a pydantic answer, a
    dict or a Response; it checks what it can at once and hands model work to the worker."""

    def __init__(self, svc: Service) -> None:
        self.svc, self.ops = svc, Ops(svc)

    def healthz(self, request, owner, body):
        return {"status": "ok"}

    def capabilities(self, request, owner, body):
        flags = {"trainable": True, "sampleable": True}
        supported = [types.SupportedModel(model_name=n, **flags) for n in self.svc.paths]
        return types.GetServerCapabilitiesResponse(supported_models=supported)

    def client_config(self, request, owner, body):
        # API keys only, plain httpx, one chunk at a time (requests run in the order sent).
        off = ("pjwt_auth_enabled", "use_pyqwest_transport", "parallel_fwdbwd_chunks")
        return types.ClientConfigResponse(**dict.fromkeys(off, False))

    def dynamic_config(self, request, owner, body):
        return types.ClientDynamicConfigResponse()

    def telemetry(self, request, owner, body):
        return {"status": "accepted"}

    def create_session(self, request, owner, body):
        _parse(types.CreateSessionRequest, body)
        sid = f"session-{secrets.token_hex(12)}"
        self.svc.sessions[sid] = Session(sid, owner)
        return types.CreateSessionResponse(session_id=sid)

    def heartbeat(self, request, owner, body):
        req = _parse(types.SessionHeartbeatRequest, body)
        s = self.svc._mine(self.svc.sessions, "session_id", req.session_id, owner)
        if s.ended:
            return JSONResponse({"error": f"session_id={s.id}: ended"}, status_code=410)
        s.seen = time.monotonic()
        return types.SessionHeartbeatResponse()

    def create_model(self, request, owner, body):
        req = _parse(types.CreateModelRequest, body)
        self.svc.session(req.session_id, owner)
        name = self.svc.base_name(req.base_model)
        lora = req.lora_config or types.LoraConfig(rank=32)
        if lora.rank < 1 or not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise BadInput(f"lora_config.rank={lora.rank}: needs rank >= 1 and one trained part")
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise BadInput(
                f"optimizer_config.type={req.optimizer_config.type}: only adamw is served"
            )
        m = Model(
            f"{req.session_id}:train:{req.model_seq_id}", owner, req.session_id, name, lora.rank
        )
        self.svc.models[m.id] = m
        return self.svc.submit(owner, req.session_id, lambda: self.ops.create(m, lora), m.id)

    def get_info(self, request, owner, body):
        m = self.svc.model(_parse(types.GetInfoRequest, body).model_id, owner)
        path = self.svc.paths[m.base]
        data = types.ModelData(arch="lora", model_name=m.base, tokenizer_id=path)
        info = dict(model_id=m.id, is_lora=True, lora_rank=m.rank, model_name=m.base)
        return types.GetInfoResponse(model_data=data, **info)

    def forward_backward(self, request, owner, body):
        req = read_fwdbwd(body, request.headers.get("content-encoding"))
        m = self.svc.model(req.model_id, owner)
        ctx = self.svc.context(m.base)
        for i, row in enumerate(req.rows):
            if ctx is not None and len(row.tokens) + 1 > ctx:  # the base also reads the last target
                raise BadInput(
                    f"data[{i}].model_input: {len(row.tokens)} tokens, past the model's context of {ctx}"
                )
        if not req.forward_only:
            _loss(req.loss_fn, req.config)
            m.pending += 1
        return self.svc.submit(owner, m.session, lambda: self.ops.forward_backward(m, req), m.id)

    def optim_step(self, request, owner, body):
        req = _parse(types.OptimStepRequest, body)
        m = self.svc.model(req.model_id, owner)
        if not isinstance(req.optim_params, types.AdamParams):
            raise BadInput("optim_params: only AdamParams are served")
        _check_step(req.optim_params)
        if m.pending == 0:
            raise BadInput(
                f"model_id={m.id}: optim_step with no gradients accumulated; call forward_backward first"
            )
        m.pending = 0
        return self.svc.submit(
            owner, m.session, lambda: self.ops.optim_step(m, req.optim_params), m.id
        )

    def save_weights(self, request, owner, body):
        req = _parse(types.SaveWeightsRequest, body)
        m = self.svc.model(req.model_id, owner)
        path = _tinker_path(m.id, "weights", req.path)

        def run():
            self.ops.save(m, path, optimizer=True)
            return types.SaveWeightsResponse(path=path, type="save_weights")

        return self.svc.submit(owner, m.session, run, m.id)

    def load_weights(self, request, owner, body):
        req = _parse(types.LoadWeightsRequest, body)
        d = self.svc.ckpt_dir(owner, req.path)
        if req.model_id is not None:
            m = self.svc.model(req.model_id, owner)
        else:  # create-via-load: a new model whose first request is this load
            self.svc.session(req.session_id or "", owner)
            base = json.loads((d / "meta.json").read_text())["base_model"]
            base = self.svc.base_name(req.base_model) if req.base_model else base
            m = Model(f"{req.session_id}:train:{req.model_seq_id}", owner, req.session_id, base, 0)
            self.svc.models[m.id] = m
        return self.svc.submit(
            owner, m.session, lambda: self.ops.load(m, d, req.optimizer, req.path), m.id
        )

    def save_for_sampler(self, request, owner, body):
        req = _parse(types.SaveWeightsForSamplerRequest, body)
        m = self.svc.model(req.model_id, owner)
        path = _tinker_path(m.id, "sampler_weights", req.path) if req.path else None
        s = Sampler(f"sampler-{secrets.token_hex(12)}", owner, m.base, path, m.session, m.id)

        def run():
            self.ops.sampler_from(s, None, m.policy)
            self.svc.samplers[s.id] = s
            if path is None:
                return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=s.id)
            self.ops.save(m, path, optimizer=False)
            return types.SaveWeightsForSamplerResponseInternal(path=path)

        return self.svc.submit(owner, m.session, run, m.id)

    def create_sampling_session(self, request, owner, body):
        req = _parse(types.CreateSamplingSessionRequest, body)
        self.svc.session(req.session_id, owner)
        if req.model_path:
            d = self.svc.ckpt_dir(owner, req.model_path, "model_path")
            base = json.loads((d / "meta.json").read_text())["base_model"]
            s = Sampler(
                f"sampler-{secrets.token_hex(12)}", owner, base, req.model_path, req.session_id
            )
            mine = (x for x in self.svc.samplers.values() if x.owner == owner)
            s.engine = next((x.engine for x in mine if x.path == req.model_path), None)
            if s.engine is None:
                self.svc.submit(owner, req.session_id, lambda: self.ops.sampler_from(s, d))
        elif req.base_model:
            base = self.svc.base_name(req.base_model)
            s = Sampler(f"sampler-{secrets.token_hex(12)}", owner, base, None, req.session_id)
        else:
            raise BadInput("model_path: give model_path or base_model")
        self.svc.samplers[s.id] = s
        return types.CreateSamplingSessionResponse(sampling_session_id=s.id)

    def join_sampling_session(self, request, owner, body):
        req = _parse(types.JoinSamplingSessionRequest, body)
        s = self.svc._mine(self.svc.samplers, "sampling_session_id", req.sampling_session_id, owner)
        s.clients += 1
        return types.JoinSamplingSessionResponse(client_counter=s.clients)

    def asample(self, request, owner, body):
        req = _parse(types.SampleRequest, body)
        s = self.svc._mine(self.svc.samplers, "sampling_session_id", req.sampling_session_id, owner)
        prompt = req.prompt.to_ints()
        ctx = self.svc.context(s.base)
        if not prompt:
            raise BadInput("prompt: empty; a prompt needs at least one token")
        if req.num_samples < 1:
            raise BadInput(f"num_samples={req.num_samples}: must be >= 1")
        if ctx is not None and len(prompt) + (req.sampling_params.max_tokens or 0) > ctx:
            asked = f"{len(prompt)} tokens + max_tokens={req.sampling_params.max_tokens}"
            raise BadInput(f"prompt: {asked} is past the model's context of {ctx}")
        p = req.sampling_params  # a seeded request samples alone, as it would on its own
        key = (s.id, p.model_dump_json(), req.num_samples) if p.seed is None else object()
        out = self.svc.submit(
            owner, s.session, lambda reqs: self.ops.sample(s, reqs), key=key, arg=req
        )
        return {
            **out,
            "sample_sequence_ids": [secrets.token_hex(8) for _ in range(req.num_samples)],
        }

    def cancel_future(self, request, owner, body):
        return {}

    def end_session(self, sid: str, owner: str) -> dict:
        s = self.svc._mine(self.svc.sessions, "session_id", sid, owner)
        s.ended = True
        for m in [m for m in self.svc.models.values() if m.session == sid and m.policy is not None]:
            self.svc.submit(owner, sid, m.policy.close)  # the adapter's memory; checkpoints stay
        return {}

    def get_sampler(self, sid: str, owner: str) -> types.GetSamplerResponse:
        s = self.svc._mine(self.svc.samplers, "sampler_id", sid, owner)
        return types.GetSamplerResponse(sampler_id=s.id, base_model=s.base, model_path=s.path)


# /api/v1/PATH -> (method, Face method)
ROUTES = {
    "healthz": ("GET", "healthz"),
    "get_server_capabilities": ("GET", "capabilities"),
    "client/config": ("POST", "client_config"),
    "client/dynamic_config": ("POST", "dynamic_config"),
    "telemetry": ("POST", "telemetry"),
    "create_session": ("POST", "create_session"),
    "session_heartbeat": ("POST", "heartbeat"),
    "create_model": ("POST", "create_model"),
    "get_info": ("POST", "get_info"),
    "forward_backward": ("POST", "forward_backward"),
    "optim_step": ("POST", "optim_step"),
    "save_weights": ("POST", "save_weights"),
    "load_weights": ("POST", "load_weights"),
    "save_weights_for_sampler": ("POST", "save_for_sampler"),
    "create_sampling_session": ("POST", "create_sampling_session"),
    "join_sampling_session": ("POST", "join_sampling_session"),
    "asample": ("POST", "asample"),
    "cancel_future": ("POST", "cancel_future"),
}


def create_app(svc: Service) -> FastAPI:
    app, face = FastAPI(), Face(svc)

    def handler(fn):
        async def run(request: Request):
            try:
                owner = svc.owner(request)
                out = fn(request, owner, await request.body())
            except BadInput as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            except Refused as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)
            if isinstance(out, Response):
                return out
            return JSONResponse(
                out if isinstance(out, dict) else out.model_dump(mode="json", exclude_none=True)
            )

        return run

    for path, (method, name) in ROUTES.items():
        app.add_api_route(f"/api/v1/{path}", handler(getattr(face, name)), methods=[method])

    @app.post("/api/v1/sessions/{sid}/finish")
    async def finish(sid: str, request: Request):
        return await handler(lambda r, owner, b: face.end_session(sid, owner))(request)

    @app.get("/api/v1/samplers/{sid}")
    async def get_sampler(sid: str, request: Request):
        return await handler(lambda r, owner, b: face.get_sampler(sid, owner))(request)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        # Long poll: hold the request until the worker finishes the work (or LONG_POLL_S
        # passed), so the SDK neither spins on "try again" nor the service on polls.
        deadline, ids = time.monotonic() + LONG_POLL_S, []

        def ask(r, owner, body):
            ids.append(_parse(types.FutureRetrieveRequest, body).request_id)
            return svc.retrieve(ids[-1], owner, time.monotonic() < deadline)

        while (out := await handler(ask)(request)).status_code == 204:
            if (fut := svc.futures.get(ids[-1])) is not None:
                event = asyncio.Event()
                fut.wake = functools.partial(
                    asyncio.get_running_loop().call_soon_threadsafe, event.set
                )
                if not fut.done:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(event.wait(), deadline - time.monotonic())
        return out

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(rest: str):
        # Billing, publishing, project and telemetry-export routes have no local meaning.
        return JSONResponse(
            {"error": f"route=/{rest}: not served by rlpost tinker (docs/tinker.md)"}, 404
        )

    return app


def _model_arg(text: str) -> tuple[str, str]:
    name, _, path = text.rpartition("=")
    path = os.path.expanduser(path)
    if not Path(path).exists():
        raise argparse.ArgumentTypeError(f"--model {text}: no such file or directory {path}")
    return name or path, path


def main(argv: list[str] | None = None) -> int:
    from rlpost.rollout.serve.net import is_loopback

    p = argparse.ArgumentParser(prog="rlpost tinker", description="the Tinker API, served locally")
    bases = "NAME=PATH (an HF directory or .gguf) or PATH; repeat for several bases"
    p.add_argument("--model", action="append", type=_model_arg, required=True, help=bases)
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs --api-key")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--state-dir", default="tinker_state", help="where tinker:// checkpoints live")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="as run.device")
    p.add_argument("--api-key", action="append", default=[], help="a key clients must send")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="what samplers run on")
    args = p.parse_args(argv)
    files = [f"{n}={path}" for n, path in args.model if not (path and Path(path).is_dir())]
    if args.engine == "vllm" and (files or importlib.util.find_spec("vllm") is None):
        why = f"serves HF directories, not {files[0]}" if files else "vLLM is not installed"
        p.exit(2, f"rlpost tinker: error: --engine vllm: {why}\n")
    keys = {*args.api_key, os.environ.get("RLPOST_API_KEY", "")} - {""}
    if not is_loopback(args.host) and not keys:
        p.exit(2, f"rlpost tinker: error: --host {args.host} is not loopback; give --api-key\n")
    import socket

    import uvicorn

    svc = Service(dict(args.model), Path(args.state_dir), keys, args.device, args.engine)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        p.exit(2, f"rlpost tinker: error: cannot bind {args.host}:{args.port} ({exc.strerror})\n")
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    print(f"rlpost tinker: listening on {url} models={','.join(svc.paths)}", flush=True)
    config = uvicorn.Config(create_app(svc), log_level="warning", access_log=False)
    # uvicorn re-raises SIGTERM once it has shut down: exit through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for base in svc.bases.values():
            base.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
