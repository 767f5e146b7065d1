"""``/v1/sync/...``: the receiving end of the ``http`` weight-sync channel in ``rlpost serve``.

    GET  /v1/sync/state               {"version", "base_version", "in_session"}
    POST /v1/sync/start               session metadata (JSON) -> 200, or 409: delta base refused
    POST /v1/sync/{session}/bucket    one bucket (safetensors bytes) -> 200, or 400: refused
    POST /v1/sync/{session}/finish    manifest (JSON) -> the commit report: version, checksums
    POST /v1/sync/{session}/abort     drop the session; the server keeps its version

One session at a time (:class:`rlpost.sync.Receiver`): a new ``start`` replaces it.
"""

from __future__ import annotations

import tempfile
import threading

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from rlpost.errors import one_line
from rlpost.rollout.serve.openai_params import APIError, error_body, parse_json_object
from rlpost.sync import DeltaRefused, Receiver, SyncError
from rlpost.sync.session import Bucket, Manifest, SessionMeta

router = APIRouter(prefix="/v1/sync")
_lock = threading.Lock()


class _ServedScheduler:
    """The scheduler seen as an engine: ``load_weights`` bounded by the server's weights timeout."""

    def __init__(self, scheduler, timeout_s: float) -> None:
        self.scheduler, self.timeout_s = scheduler, timeout_s
        self.dtypes = {n: p.dtype for n, p in scheduler._params.items()}  # it casts no raw tensor

    @property
    def version(self) -> int:
        return self.scheduler.version

    def load_weights(self, named_tensors, version: int) -> None:
        # a TensorStream: the scheduler applies it tensor by tensor between decode steps
        shapes = getattr(named_tensors, "shapes", None)
        self.scheduler.load_weights(named_tensors, version, self.timeout_s, shapes=shapes)


def receiver_of(app) -> Receiver:
    """The app's receiver, made on first use around its scheduler."""
    with _lock:
        receiver = getattr(app.state, "sync_receiver", None)
        if receiver is None:
            service, settings = app.state.service, app.state.service.settings
            # Removed with the app (TemporaryDirectory's finalizer); sessions delete their files.
            app.state.sync_spool = tempfile.TemporaryDirectory(prefix="rlpost-sync-")
            receiver = Receiver(
                _ServedScheduler(service.scheduler, settings.weights_timeout_s),
                name=f"rlpost serve ({settings.model_name})",
                spool_dir=app.state.sync_spool.name,
                timeout_s=settings.weights_timeout_s,
            )
            app.state.sync_receiver = receiver
        return receiver


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status)


async def _run(fn, *args):
    """``fn(*args)`` off the event loop; a refused session is a 4xx with its one line."""
    try:
        return await run_in_threadpool(fn, *args)
    except DeltaRefused as exc:
        return _error(409, str(exc))
    except SyncError as exc:
        return _error(500 if exc.phase == "commit" else 400, str(exc))
    except ValueError as exc:
        return _error(400, one_line(exc))


@router.get("/state")
async def state(request: Request) -> dict:
    r = receiver_of(request.app)
    return {"version": r.version, "base_version": r.base_version, "in_session": r.in_session}


@router.post("/start")
async def start(request: Request):
    try:
        meta = SessionMeta.from_json(parse_json_object(await request.body()))
    except APIError as exc:
        return _error(400, f"session metadata: {exc.message}")
    except ValueError as exc:
        return _error(400, f"session metadata: {one_line(exc)}")
    result = await _run(receiver_of(request.app).start, meta)
    return result if isinstance(result, JSONResponse) else {"session": meta.session}


@router.post("/{session}/bucket")
async def bucket(session: str, request: Request):
    receiver = receiver_of(request.app)
    result = await _run(lambda data: _update(receiver, session, data), await request.body())
    return result if isinstance(result, JSONResponse) else {"index": result}


def _update(receiver: Receiver, session: str, data: bytes) -> int:
    b = Bucket.from_bytes(data)
    if b.session != session:
        raise ValueError(f"bucket belongs to session {b.session}, posted to {session}")
    receiver.update(b)
    return b.index


@router.post("/{session}/finish")
async def finish(session: str, request: Request):
    try:
        manifest = Manifest.from_json(parse_json_object(await request.body()))
    except APIError as exc:
        return _error(400, exc.message)
    except ValueError as exc:
        return _error(400, one_line(exc))
    if manifest.session != session:
        return _error(400, f"manifest belongs to session {manifest.session}, posted to {session}")
    report = await _run(receiver_of(request.app).finish, manifest)
    if isinstance(report, JSONResponse):
        return report
    service = request.app.state.service
    service.weights_run_id = receiver_of(request.app).run_id
    seconds, size = report.pause_seconds, report.bytes
    service.recorder.record(report.version, {"sync_seconds": seconds, "sync_bytes": size})
    answer = {"version": report.version, "checksums": report.checksums}
    return {**answer, "pause_seconds": seconds, "bytes": size}


@router.post("/{session}/abort")
async def abort(session: str, request: Request) -> dict:
    await run_in_threadpool(receiver_of(request.app).abort, session)
    return {"aborted": session}
