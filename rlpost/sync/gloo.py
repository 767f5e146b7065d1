"""The ``gloo`` channel: torch.distributed between the trainer and engines in other processes.

Rank 0 sends; ranks 1..N run :func:`serve_gloo` around their engine. Control messages go
through the group's TCPStore keyed by a sequence number, so a receiver waits idle between
syncs; bucket payloads are one ``broadcast`` each. The group is a standalone ProcessGroup, so
a trainer's own torch.distributed is untouched. Every control message is signed
(HMAC-SHA256) with a key broadcast over the group's sockets, which a store client never
sees; one failing its signature or schema is refused with one log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rlpost.sync.listen import gloo_options, pin_interface, tcp_store
from rlpost.sync.receiver import CommitReport, Receiver
from rlpost.sync.session import Bucket, DeltaRefused, Manifest, SessionMeta, SyncError, sync_error

IDLE_POLL_S = 1.0  # how often an idle receiver re-checks for the next message
KEY_BYTES = 32
OPS = ("start", "update", "finish", "abort", "close")
HEADER_KEYS = {"session", "index", "entries", "crc"}
log = logging.getLogger(__name__)


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
    """(store, group, signing key) of ``rank``; the key travels over the group, not the store."""
    timeout = timedelta(seconds=timeout_s)
    store = tcp_store(link.host, link.port, link.world_size, rank == 0, timeout)
    if link.backend == "nccl":
        pin_interface(link.host, "NCCL_SOCKET_IFNAME")
        group = dist.ProcessGroupNCCL(store, rank, link.world_size)
    else:
        opts = gloo_options(link.host, timeout)
        group = dist.ProcessGroupGloo(store, rank, link.world_size, opts)
    key = torch.zeros(KEY_BYTES, dtype=torch.uint8)
    if rank == 0:
        key = torch.frombuffer(bytearray(os.urandom(KEY_BYTES)), dtype=torch.uint8)
    key = key.to(_device(link))
    _broadcast(group, key)
    return store, group, bytes(key.cpu().tolist())


def _mac(key: bytes, name: str, text: str) -> str:
    return hmac.new(key, f"{name}\n{text}".encode(), hashlib.sha256).hexdigest()


def _sign(key: bytes, name: str, text: str) -> str:
    """``mac \\n text``: the store value of message or reply ``name`` (``msg/3``)."""
    return f"{_mac(key, name, text)}\n{text}"


def _verify(key: bytes, name: str, raw: bytes) -> dict:
    """The message in store value ``raw``; ValueError (one line) when it is not ours."""
    mac, sep, text = raw.decode("utf-8", "replace").partition("\n")
    if not sep or not hmac.compare_digest(mac, _mac(key, name, text)):
        raise ValueError("its signature does not match this group's key")
    try:
        msg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"it is not JSON ({exc.msg})") from None
    if not isinstance(msg, dict):
        raise ValueError("it is not a JSON object")
    return msg


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
        with sync_error("init", self.target):  # rendezvous fails as several torch types
            self.store, self.group, self.key = _connect(link, 0, options.timeout_s)
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
        with sync_error("update", self.target):
            _broadcast(self.group, bucket.payload.to(_device(self.link)))

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
        with contextlib.suppress(SyncError):  # receivers drop a session whose sender went away
            self._send("abort", {"op": "abort"})

    def close(self) -> None:
        with contextlib.suppress(SyncError):  # receivers already gone have nothing to close
            self._send("close", {"op": "close"})

    def _forget(self) -> None:
        """Delete the keys of messages every receiver has read, so the store does not grow."""
        with sync_error("start", self.target):
            for seq in range(self.forgotten + 1, self.acked + 1):
                self.store.delete_key(f"msg/{seq}")
                for r in range(1, self.link.world_size):
                    self.store.delete_key(f"reply/{seq}/{r}")
        self.forgotten = self.acked

    def _send(self, phase: str, msg: dict) -> None:
        self.seq += 1
        name = f"msg/{self.seq}"
        with sync_error(phase, self.target):
            self.store.set(name, _sign(self.key, name, json.dumps(msg)))

    def _call(self, phase: str, msg: dict) -> list[dict]:
        self._send(phase, msg)
        keys = [f"reply/{self.seq}/{r}" for r in range(1, self.link.world_size)]
        deadline = time.monotonic() + self.timeout_s
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
            replies = [self._reply(k, deadline) for k in keys]
        except SyncError:
            raise
        except Exception as exc:
            raise SyncError(
                phase, self.target, f"no reply within {self.timeout_s:g} s ({type(exc).__name__})"
            ) from None
        self.acked = self.seq
        return replies

    def _reply(self, name: str, deadline: float) -> dict:
        """A receiver's signed reply; a forged one is refused and the real one awaited."""
        forged = None
        while True:
            raw = self.store.get(name)
            if raw != forged:
                try:
                    return _verify(self.key, name, raw)
                except ValueError as exc:
                    log.warning("%s: refused a forged reply at %s: %s", self.target, name, exc)
                    forged = raw
            if time.monotonic() > deadline:
                raise SyncError("reply", self.target, f"only forged replies at {name}")
            time.sleep(0.05)

    def _raise_first(self, phase: str, replies: list[dict]) -> None:
        for r in replies:
            if r.get("error"):
                raise SyncError(phase, self.target, r["error"])


def serve_gloo(
    engine, link: GlooLink, rank: int, *, verify: bool = True, timeout_s: float = 300.0
) -> None:
    """Receive sessions for ``engine`` as ``rank`` until the sender closes the group (a
    SyncError when it goes away)."""
    name = f"{link} rank {rank}"
    store, group, key = _connect(link, rank, timeout_s)
    receiver = Receiver(engine, name=name, verify=verify, timeout_s=timeout_s)
    seq, error, bucket_bytes = 0, None, 0
    while True:
        seq += 1
        msg = _next_message(store, key, seq, name, receiver, timeout_s, bucket_bytes)
        op, reply = msg["op"], None
        if op == "start":
            error, reply = None, _start(receiver, msg)
            bucket_bytes = _bucket_bytes(msg)
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
                error = _update(receiver, msg, payload)
        elif op == "finish":
            reply = {"error": error} if error else _finish(receiver, msg)
        elif op == "abort":
            receiver.abort()
        elif op == "close":
            return
        if reply is not None:
            slot = f"reply/{seq}/{rank}"
            store.set(slot, _sign(key, slot, json.dumps(reply)))


def _bucket_bytes(msg: dict) -> int:
    meta = msg.get("meta")
    size = meta.get("bucket_bytes") if isinstance(meta, dict) else None
    return size if isinstance(size, int) and size > 0 else 0


def _update(receiver: Receiver, msg: dict, payload: torch.Tensor) -> str | None:
    """Stage one bucket; the error to report at finish, if any (later buckets are drained)."""
    header = msg.get("header")
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        receiver.abort()
        return f"weight sync update on {receiver.name}: bad bucket header {got}"
    try:
        receiver.update(Bucket(payload=payload.cpu(), **header))
    except SyncError as exc:
        return str(exc)
    return None


def _refusal(msg: dict, bucket_bytes: int) -> str | None:
    """Why a signed message cannot be acted on, or None."""
    op = msg.get("op")
    if op not in OPS:
        return f"unknown op {op!r}"
    if op == "update":
        size = msg.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"payload size {size!r} is not a byte count"
        if size > bucket_bytes:
            return f"payload size {size} exceeds the session's bucket_bytes {bucket_bytes}"
    return None


def _next_message(
    store, key: bytes, seq: int, name: str, receiver: Receiver, timeout_s: float, bucket_bytes=0
) -> dict:
    """The next control message, signed and well formed; idle waits are unbounded, waits
    inside a session are not. A forged value is refused once and the real one awaited."""
    slot, waited, forged = f"msg/{seq}", 0.0, None
    while True:
        try:
            store.wait([slot], timedelta(seconds=IDLE_POLL_S))
            raw = store.get(slot)
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                receiver.abort()
                raise SyncError("update", name, f"sender gone: {type(exc).__name__}") from None
            raw = None
        except Exception as exc:  # the store's socket closed: the sender is gone
            receiver.abort()
            raise SyncError("update", name, f"sender gone: {type(exc).__name__}") from None
        if raw is not None and raw != forged:
            try:
                msg = _verify(key, slot, raw)
            except ValueError as exc:
                log.warning("%s: refused a forged message at %s: %s", name, slot, exc)
                forged = raw
                continue
            why = _refusal(msg, bucket_bytes)
            if why is None:
                return msg
            # signed, so the sender's own: a payload may follow that cannot be drained
            receiver.abort()
            raise SyncError("update", name, f"refused message {slot}: {why}")
        if raw is not None:
            time.sleep(IDLE_POLL_S)  # the forged value is still there
        waited += IDLE_POLL_S
        if receiver.in_session and waited > timeout_s:
            receiver.abort()
            raise SyncError("update", name, f"sender silent for {timeout_s:g} s mid-session")


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
