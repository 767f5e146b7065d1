"""The ``gloo`` channel: torch.distributed between the trainer and engines in other processes.

Rank 0 is the sender; ranks 1..N run :func:`serve_gloo` around their engine
(another process, or a Ray actor). Control messages (start, each bucket's
header, finish, and every receiver's reply) go through the group's TCPStore,
keyed by a sequence number, so a receiver can wait idle between syncs for as
long as training takes, and a dead sender is noticed when the store's socket
closes. Bucket payloads travel as one ``broadcast`` each from rank 0. With
``backend="nccl"`` the same code broadcasts CUDA tensors over NCCL (not run
here: no GPU).

The group is a standalone ProcessGroup on its own store, not the default
group, so a trainer that already runs torch.distributed (FSDP) is untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rlpost.sync.receiver import CommitReport, Receiver
from rlpost.sync.session import Bucket, DeltaRefused, Manifest, SessionMeta, SyncError

IDLE_POLL_S = 1.0  # how often an idle receiver re-checks for the next message


@dataclass(frozen=True)
class GlooLink:
    """Where a sync group meets: rank 0 (the sender) hosts the store on ``host:port``."""

    host: str
    port: int
    world_size: int  # the sender plus its receivers
    backend: str = "gloo"  # "nccl" on GPUs

    def __str__(self) -> str:
        return f"{self.backend}://{self.host}:{self.port}"


def _connect(link: GlooLink, rank: int, timeout_s: float):
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(link.host, link.port, link.world_size, rank == 0, timeout)
    if link.backend == "nccl":
        group = dist.ProcessGroupNCCL(store, rank, link.world_size)
    else:
        group = dist.ProcessGroupGloo(store, rank, link.world_size, timeout)
    return store, group


def _device(link: GlooLink) -> str:
    return "cuda" if link.backend == "nccl" else "cpu"


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class GlooTransport:
    """Rank 0 of a sync group: one target standing for all its receivers."""

    supports_delta = True

    def __init__(self, link: GlooLink, options) -> None:
        if not isinstance(link, GlooLink):
            raise ValueError("sync.channel=gloo targets are GlooLink(host, port, world_size)")
        self.link, self.target, self.timeout_s = link, str(link), options.timeout_s
        try:
            self.store, self.group = _connect(link, 0, options.timeout_s)
        except Exception as exc:  # rendezvous failures come as several torch error types
            raise SyncError("init", self.target, f"{type(exc).__name__}: {exc}") from None
        self.seq = 0
        self.acked = 0  # every receiver has read the messages up to this one (it replied)
        self.forgotten = 0  # keys up to this sequence number were deleted from the store

    def start(self, meta: SessionMeta) -> None:
        self._forget()
        replies = self._call("start", {"op": "start", "meta": meta.to_json()})
        for r in replies:
            if r.get("refused"):
                raise DeltaRefused("start", self.target, r["error"])
        self._raise_first("start", replies)

    def update(self, bucket: Bucket) -> None:
        self._send(
            "update", {"op": "update", "header": bucket.header(), "size": bucket.payload.numel()}
        )
        try:
            _broadcast(self.group, bucket.payload.to(_device(self.link)))
        except Exception as exc:
            raise SyncError("update", self.target, f"{type(exc).__name__}: {exc}") from None

    def finish(self, manifest: Manifest) -> CommitReport:
        replies = self._call("finish", {"op": "finish", "manifest": manifest.to_json()})
        self._raise_first("finish", replies)
        reports = [CommitReport(**r["report"]) for r in replies]
        for rank, r in enumerate(reports[1:], start=2):
            if r.checksums != reports[0].checksums:
                raise SyncError(
                    "verify", self.target, f"rank {rank} serves other weights than rank 1"
                )
        return reports[0]

    def abort(self) -> None:
        try:
            self._send("abort", {"op": "abort"})
        except SyncError:
            pass  # the receivers also drop a session whose sender went away

    def close(self) -> None:
        try:
            self._send("close", {"op": "close"})
        except SyncError:
            pass  # receivers that are already gone have nothing left to close

    def _forget(self) -> None:
        """Delete the keys of messages every receiver has read, so the store does not grow."""
        try:
            for seq in range(self.forgotten + 1, self.acked + 1):
                self.store.delete_key(f"msg/{seq}")
                for r in range(1, self.link.world_size):
                    self.store.delete_key(f"reply/{seq}/{r}")
        except Exception as exc:
            raise SyncError("start", self.target, f"{type(exc).__name__}: {exc}") from None
        self.forgotten = self.acked

    def _send(self, phase: str, msg: dict) -> None:
        self.seq += 1
        try:
            self.store.set(f"msg/{self.seq}", json.dumps(msg))
        except Exception as exc:
            raise SyncError(phase, self.target, f"{type(exc).__name__}: {exc}") from None

    def _call(self, phase: str, msg: dict) -> list[dict]:
        self._send(phase, msg)
        keys = [f"reply/{self.seq}/{r}" for r in range(1, self.link.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
            replies = [json.loads(self.store.get(k)) for k in keys]
        except Exception as exc:
            raise SyncError(
                phase, self.target, f"no reply within {self.timeout_s:g} s ({type(exc).__name__})"
            ) from None
        self.acked = self.seq
        return replies

    def _raise_first(self, phase: str, replies: list[dict]) -> None:
        for r in replies:
            if r.get("error"):
                raise SyncError(phase, self.target, r["error"])


def serve_gloo(
    engine, link: GlooLink, rank: int, *, verify: bool = True, timeout_s: float = 300.0
) -> None:
    """Receive sessions for ``engine`` as ``rank`` until the sender closes the group.

    Raises SyncError when the sender goes away; the engine then keeps the last
    version it committed.
    """
    name = f"{link} rank {rank}"
    store, group = _connect(link, rank, timeout_s)
    receiver = Receiver(engine, name=name, verify=verify, timeout_s=timeout_s)
    seq, error = 0, None
    while True:
        seq += 1
        msg = _next_message(store, seq, name, receiver, timeout_s)
        op, reply = msg["op"], None
        if op == "start":
            error, reply = None, _start(receiver, msg)
        elif op == "update":
            payload = torch.empty(msg["size"], dtype=torch.uint8, device=_device(link))
            try:
                _broadcast(group, payload)
            except Exception as exc:
                receiver.abort()
                raise SyncError(
                    "update", name, f"sender gone: {type(exc).__name__}: {exc}"
                ) from None
            if error is None:
                try:
                    receiver.update(Bucket(payload=payload.cpu(), **msg["header"]))
                except SyncError as exc:
                    error = str(exc)  # reported at finish; later buckets are drained
        elif op == "finish":
            reply = {"error": error} if error else _finish(receiver, msg)
        elif op == "abort":
            receiver.abort()
        elif op == "close":
            return
        if reply is not None:
            store.set(f"reply/{seq}/{rank}", json.dumps(reply))


def _next_message(store, seq: int, name: str, receiver: Receiver, timeout_s: float) -> dict:
    """The next control message; idle waits are unbounded, waits inside a session are not."""
    waited = 0.0
    while True:
        try:
            store.wait([f"msg/{seq}"], timedelta(seconds=IDLE_POLL_S))
            return json.loads(store.get(f"msg/{seq}"))
        except dist.DistStoreError as exc:
            in_session = receiver.in_session
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                receiver.abort()
                raise SyncError("update", name, f"sender gone: {type(exc).__name__}") from None
            waited += IDLE_POLL_S
            if in_session and waited > timeout_s:
                receiver.abort()
                raise SyncError(
                    "update", name, f"sender silent for {timeout_s:g} s mid-session"
                ) from None
        except Exception as exc:  # the store's socket closed: the sender is gone
            receiver.abort()
            raise SyncError("update", name, f"sender gone: {type(exc).__name__}") from None


def _start(receiver: Receiver, msg: dict) -> dict:
    try:
        receiver.start(SessionMeta.from_json(msg["meta"]))
    except DeltaRefused as exc:
        return {"error": str(exc), "refused": True}
    except (SyncError, ValueError) as exc:
        return {"error": str(exc)}
    return {"ok": True}


def _finish(receiver: Receiver, msg: dict) -> dict:
    try:
        report = receiver.finish(Manifest.from_json(msg["manifest"]))
    except (SyncError, ValueError) as exc:
        return {"error": str(exc)}
    return {"report": {**report.__dict__}}
