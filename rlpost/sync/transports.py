"""Transports: how one sender reaches one target, behind one small protocol.

Each carries one session (:mod:`rlpost.sync.session`): ``start(meta)``, ``update(bucket)``,
``finish(manifest) -> CommitReport``; registered by ``sync.channel``.

* ``inprocess``: a :class:`~rlpost.sync.receiver.Receiver` around an engine in this process.
* ``http``: one request per bucket to ``rlpost serve``'s ``/v1/sync`` routes.
* ``disk`` and ``gloo``: :mod:`rlpost.sync.disk`, :mod:`rlpost.sync.gloo`.
* ``vllm``: see :class:`VllmTransport` (small and not yet run on a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from rlpost.errors import http_error_line
from rlpost.sync.receiver import CommitReport, Receiver
from rlpost.sync.session import Bucket, DeltaRefused, Manifest, SessionMeta, SyncError, sync_error


@dataclass
class TransportOptions:
    verify: bool = True
    timeout_s: float = 300.0
    headers: dict[str, str] | None = None  # sent with every http request (e.g. an admin key)


class Transport(Protocol):
    """One target of a sync. Errors are :class:`SyncError` naming phase and ``target``."""

    target: str
    supports_delta: bool

    def start(self, meta: SessionMeta) -> None: ...
    def update(self, bucket: Bucket) -> None: ...
    def finish(self, manifest: Manifest) -> CommitReport: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


TRANSPORTS: dict[str, Callable[[object, TransportOptions], Transport]] = {}


def register_transport(name: str, factory: Callable[[object, TransportOptions], Transport]):
    TRANSPORTS[name] = factory


def make_transport(name: str, target, options: TransportOptions) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown sync channel {name!r}; valid: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](target, options)


class InProcessTransport:
    """A receiver around an engine of this process; the receiver (and its delta base) persists."""

    supports_delta = True

    def __init__(self, engine, options: TransportOptions, name: str | None = None) -> None:
        self.receiver = Receiver(
            engine,
            name=name or type(engine).__name__,
            verify=options.verify,
            timeout_s=options.timeout_s,
        )

    @property
    def target(self) -> str:
        return self.receiver.name

    @target.setter
    def target(self, name: str) -> None:
        self.receiver.name = name

    def start(self, meta: SessionMeta) -> None:
        self.receiver.start(meta)

    def update(self, bucket: Bucket) -> None:
        self.receiver.update(bucket)

    def finish(self, manifest: Manifest) -> CommitReport:
        return self.receiver.finish(manifest)

    def abort(self) -> None:
        self.receiver.abort()

    def close(self) -> None:
        self.receiver.abort()


class HttpTransport:
    """Client of ``rlpost serve``'s ``/v1/sync`` routes; every request has ``timeout_s``."""

    supports_delta = True

    def __init__(self, url: str, options: TransportOptions) -> None:
        self.target = url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.target, timeout=options.timeout_s, headers=options.headers
        )
        self.session: str | None = None

    def start(self, meta: SessionMeta) -> None:
        self.session = meta.session
        self._post("start", "/v1/sync/start", json=meta.to_json())

    def update(self, bucket: Bucket) -> None:
        headers = {"content-type": "application/octet-stream"}
        path = f"/v1/sync/{bucket.session}/bucket"
        self._post("update", path, content=bucket.to_bytes(), headers=headers)

    def finish(self, manifest: Manifest) -> CommitReport:
        body = self._post("finish", f"/v1/sync/{manifest.session}/finish", json=manifest.to_json())
        sums = {k: int(v) for k, v in body.get("checksums", {}).items()}
        return CommitReport(
            int(body["version"]), sums, float(body["pause_seconds"]), int(body["bytes"])
        )

    def abort(self) -> None:
        if self.session is not None:
            # best effort: the server also drops an idle session
            with contextlib.suppress(httpx.HTTPError):
                self.http.post(f"/v1/sync/{self.session}/abort", timeout=5.0)

    def close(self) -> None:
        self.http.close()

    def _post(self, phase: str, path: str, **kwargs) -> dict:
        with sync_error(phase, self.target, httpx.TransportError):  # refused, reset, timed out
            r = self.http.post(path, **kwargs)
        if r.status_code == 409 and phase == "start":
            raise DeltaRefused(phase, self.target, http_error_line(r))
        if r.status_code >= 400:
            raise SyncError(phase, self.target, f"HTTP {r.status_code}: {http_error_line(r)}")
        return r.json()


class VllmTransport(InProcessTransport):
    """Into a vLLM engine of this process: staged as ``inprocess``, then committed through the
    workers' ``load_weights`` (collective_rpc); not yet run on a GPU."""

    def __init__(self, engine, options: TransportOptions) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ImportError(
                "sync.channel=vllm needs the [vllm] extra: pip install 'rlpost[vllm]'"
            ) from None
        super().__init__(engine, options)


def _disk(target, options):
    from rlpost.sync.disk import DiskTransport

    return DiskTransport(target, options)


def _gloo(target, options):
    from rlpost.sync.gloo import GlooTransport

    return GlooTransport(target, options)


register_transport("inprocess", InProcessTransport)
register_transport("http", HttpTransport)
register_transport("disk", _disk)
register_transport("gloo", _gloo)
register_transport("vllm", VllmTransport)
