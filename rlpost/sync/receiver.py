"""The receiving side of a sync session, for any engine with ``load_weights``.

Buckets are staged (in memory or spooled to files) and nothing reaches the engine until
``finish`` has checked every bucket's CRC and tensor checksum, so a failed session leaves the
old version serving. The commit streams (:class:`TensorStream`). Delta sessions keep a bf16
copy of the committed weights as the next base.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlpost.sync import delta as _delta  # noqa: F401  (registers the delta codec)
from rlpost.sync.codecs import CODECS
from rlpost.sync.session import (
    PART_SEP,
    Bucket,
    DeltaRefused,
    Manifest,
    SessionMeta,
    SyncError,
    checksum,
    sync_error,
    to_dtype,
)


@dataclass
class CommitReport:
    """What a receiver answers to ``finish``: the version it now serves and what it checked."""

    version: int
    checksums: dict[str, int] = field(default_factory=dict)
    pause_seconds: float = 0.0
    bytes: int = 0
    served: bool = True  # False: nothing serves it yet (a published disk version)


def _entries_fit(entries: list, size: int) -> bool:
    """Each entry ``[key, total, offset, length]`` lies inside its part, and together they fill the payload."""
    try:
        inside = all(0 <= off and 0 <= n and off + n <= total for _, total, off, n in entries)
        return inside and sum(n for *_, n in entries) == size
    except (TypeError, ValueError):
        return False


class TensorStream:
    """``(name, tensor)`` pairs produced lazily, with every ``shapes[name]`` known ahead."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], shapes: dict[str, tuple]) -> None:
        self.items, self.shapes = items, shapes

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.items


def decoded_shape(spec) -> tuple[int, ...]:
    """The shape a manifest entry decodes to (an unknown codec fails at decode)."""
    if spec.codec not in CODECS:
        return ()
    shapes = {part: shape for part, (_, shape) in spec.parts.items()}
    return tuple(CODECS.get(spec.codec).shape(shapes, spec.meta))


@dataclass
class _Staged:
    meta: SessionMeta
    buckets: list = field(default_factory=list)  # payload tensors, or spool file paths
    entries: list[list] = field(default_factory=list)  # each bucket's header entries
    bytes: int = 0
    touched: float = field(default_factory=time.monotonic)


class Receiver:
    """Stages a session's buckets and commits them to ``engine`` atomically."""

    def __init__(
        self,
        engine,
        *,
        name: str = "engine",
        verify: bool = True,
        spool_dir: str | Path | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.engine, self.name, self.verify, self.timeout_s = engine, name, verify, timeout_s
        self.spool_dir = Path(spool_dir) if spool_dir is not None else None
        self._version = _engine_version(engine, 0)
        self.base_version: int | None = None
        self.run_id = ""  # the run id of the weights committed last (SessionMeta.run_id)
        self._base: dict[str, torch.Tensor] = {}
        self._staged: _Staged | None = None
        self._lock = threading.RLock()

    @property
    def version(self) -> int:
        """The version the engine serves (it may also load weights by other routes)."""
        return _engine_version(self.engine, self._version)

    @property
    def in_session(self) -> bool:
        return self._staged is not None

    def start(self, meta: SessionMeta) -> None:
        with self._lock:
            self._drop()  # a new session replaces an unfinished one (its sender restarted)
            if meta.base_version is not None and meta.base_version != self.base_version:
                have = (
                    "no base" if self.base_version is None else f"base version {self.base_version}"
                )
                raise DeltaRefused(
                    "start",
                    self.name,
                    f"delta against version {meta.base_version} refused: this engine holds {have}; send a full sync",
                )
            self._staged = _Staged(meta)

    def update(self, bucket: Bucket) -> None:
        with self._lock:
            staged = self._session("update", bucket.session)
            if bucket.index != len(staged.buckets):
                self._fail(
                    "update", f"bucket {bucket.index} arrived, expected {len(staged.buckets)}"
                )
            if checksum(bucket.payload) != bucket.crc:
                self._fail("update", f"bucket {bucket.index} failed its CRC check (corrupted)")
            if bucket.payload.numel() > staged.meta.bucket_bytes:
                self._fail("update", f"bucket {bucket.index} is larger than bucket_bytes")
            if not _entries_fit(bucket.entries, bucket.payload.numel()):
                self._fail("update", f"bucket {bucket.index} has entries outside its payload")
            staged.buckets.append(self._stage(staged, bucket))
            staged.entries.append(bucket.entries)
            staged.bytes += bucket.payload.numel()
            staged.touched = time.monotonic()

    def finish(self, manifest: Manifest) -> CommitReport:
        """Check every bucket and tensor, then commit; the engine keeps its version on any error."""
        with self._lock:
            staged = self._session("finish", manifest.session)
            try:
                return self._commit(staged, manifest)
            finally:
                self._drop()

    def abort(self, session: str | None = None) -> None:
        """Drop the open session (only if it is ``session``, when given)."""
        with self._lock:
            if session is None or (
                self._staged is not None and self._staged.meta.session == session
            ):
                self._drop()

    def _commit(self, staged: _Staged, manifest: Manifest) -> CommitReport:
        if manifest.buckets != len(staged.buckets):
            self._fail("finish", f"{len(staged.buckets)} of {manifest.buckets} buckets arrived")
        served = getattr(self.engine, "dtypes", {})  # an engine that casts no raw tensor
        # pass 1 rebuilds every tensor before the engine sees any: a failure changes nothing
        for spec, tensor in zip(manifest.tensors, self._tensors(staged, manifest), strict=True):
            if self.verify and checksum(tensor) != spec.checksum:
                self._fail("finish", f"tensor {spec.name!r} does not match its checksum; refused")
            want = served.get(spec.name, tensor.dtype)  # other codecs decode to the model's dtype
            if tensor.dtype != want and CODECS.trait(spec.codec, "identity"):
                self._fail("finish", f"tensor {spec.name!r} has dtype {tensor.dtype}, not {want}")
        sums: dict[str, int] = {}
        new_base: dict[str, torch.Tensor] = {}

        def stream():
            for spec, tensor in zip(manifest.tensors, self._tensors(staged, manifest), strict=True):
                if self.verify:
                    sums[spec.name] = checksum(tensor)
                if staged.meta.delta:
                    new_base[spec.name] = tensor.to(torch.bfloat16)
                yield spec.name, tensor

        start = time.perf_counter()
        with sync_error("commit", self.name):
            self.engine.load_weights(
                TensorStream(stream(), {s.name: decoded_shape(s) for s in manifest.tensors}),
                staged.meta.version,
            )
        pause = time.perf_counter() - start
        self._version = staged.meta.version
        self.run_id = staged.meta.run_id
        self._base = new_base
        self.base_version = staged.meta.version if staged.meta.delta else None
        return CommitReport(staged.meta.version, sums, pause, staged.bytes)

    def _tensors(self, staged: _Staged, manifest: Manifest) -> Iterator[torch.Tensor]:
        """Tensors of the manifest in order, rebuilt while buckets are read one at a time."""
        specs = list(manifest.tensors)
        done: dict[str, torch.Tensor] = {}  # finished parts of tensors not yet complete
        filled: dict[str, int] = {}
        building: dict[str, torch.Tensor] = {}
        at = 0  # next spec to yield
        for i, entries in enumerate(staged.entries):
            payload, pos = self._payload(staged, i), 0
            for key, total, offset, length in entries:
                buf = building.setdefault(key, torch.empty(total, dtype=torch.uint8))
                buf[offset : offset + length] = payload[pos : pos + length]
                pos += length
                filled[key] = filled.get(key, 0) + length
                if filled[key] == total:
                    done[key] = building.pop(key)
            while at < len(specs) and all(
                f"{specs[at].name}{PART_SEP}{p}" in done for p in specs[at].parts
            ):
                yield self._decode(specs[at], done)
                at += 1
        if at != len(specs):
            self._fail("finish", f"tensor {specs[at].name!r} is incomplete in the buckets")

    def _decode(self, spec, done: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = {}
        for part, (dtype, shape) in spec.parts.items():
            raw = done.pop(f"{spec.name}{PART_SEP}{part}")
            parts[part] = raw.view(to_dtype(dtype)).reshape(shape)
        if spec.codec not in CODECS:
            self._fail("finish", f"tensor {spec.name!r} uses unknown codec {spec.codec!r}")
        codec = CODECS.get(spec.codec)
        if not CODECS.trait(spec.codec, "needs_base"):
            return codec.decode(parts, spec.meta)
        base = self._base.get(spec.name)
        if base is None:
            self._fail("finish", f"delta for {spec.name!r} but no base tensor is held")
        return codec.decode(parts, spec.meta, base)

    def _stage(self, staged: _Staged, bucket: Bucket):
        if self.spool_dir is None:
            return bucket.payload
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        path = self.spool_dir / f"{staged.meta.session}-{bucket.index:06d}.bin"
        bucket.payload.numpy().tofile(path)
        return path

    def _payload(self, staged: _Staged, i: int) -> torch.Tensor:
        item = staged.buckets[i]
        if isinstance(item, Path):
            return torch.from_file(str(item), size=os.path.getsize(item), dtype=torch.uint8)
        return item

    def _session(self, phase: str, session: str) -> _Staged:
        staged = self._staged
        if staged is not None and time.monotonic() - staged.touched > self.timeout_s:
            self._drop()
            self._fail(phase, f"session {session} expired after {self.timeout_s:g} s idle")
        if staged is None or staged.meta.session != session:
            self._fail(
                phase, f"no open session {session} (it was never started, replaced or aborted)"
            )
        return staged

    def _drop(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            for item in staged.buckets:
                if isinstance(item, Path):
                    item.unlink(missing_ok=True)

    def _fail(self, phase: str, message: str):
        """Drop the session (the engine keeps its version) and raise one line."""
        self._drop()
        raise SyncError(phase, self.name, message)


def _engine_version(engine, default: int) -> int:
    """An engine's ``version`` attribute, or a worker's ``version()`` method."""
    version = getattr(engine, "version", default)
    return int((version() if callable(version) else version) or 0)
