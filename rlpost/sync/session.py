"""The sync session on the wire: metadata, buckets, manifest, checksums.

A session is ``start(meta) -> update(bucket)... -> finish(manifest)``, then the
receiver commits (the shape of vLLM's weight-transfer API:
init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update). Every record here is JSON plus byte tensors, so any
transport carries it.

A bucket is one flat byte payload of at most ``meta.bucket_bytes`` bytes and a
header naming the byte ranges of codec *parts* it holds (``key``, the part's
total length, offset, length). Working in bytes makes splitting uniform: a
part larger than a bucket simply continues in the next one, whatever its codec
or dtype. Per-tensor facts (codec, dtypes, shapes, checksum) go in the manifest
sent at ``finish``, once every tensor has been encoded.
"""

from __future__ import annotations

import contextlib
import json
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from rlpost.sync.codecs import Encoded

PART_SEP = "::"  # tensor name :: part name; parameter names never contain it


class SyncError(RuntimeError):
    """A sync failure, one line: which phase, which engine, what went wrong."""

    def __init__(self, phase: str, target: str, message: str) -> None:
        super().__init__(f"weight sync {phase} on {target}: {message}")
        self.phase, self.target, self.message = phase, target, message


class DeltaRefused(SyncError):
    """The receiver's base version is not the one the delta was made from: send a full sync."""


@contextlib.contextmanager
def sync_error(phase: str, target: str, errors: type | tuple = Exception) -> Iterator[None]:
    """``errors`` raised in the block become one :class:`SyncError` line, ``Type: message``
    (a transport's errors come as many types: torch's, sockets', a store's)."""
    try:
        yield
    except errors as exc:
        raise SyncError(phase, target, f"{type(exc).__name__}: {exc}") from None


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (its dtype and layout as given; contiguous CPU copy)."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy())


@dataclass
class SessionMeta:
    """What ``start`` announces. ``base_version`` is set for delta sessions only.

    ``run_id`` names the line of weights the version belongs to: versions only grow
    within one run id, and a sender starts a new one whenever its versions restart
    (a resume or rollback reuses numbers), so a reader tells "older, ignore" from "the
    trainer went back, follow" and two trainers sharing a fleet are told apart."""

    session: str
    version: int
    codec: str
    bucket_bytes: int
    delta: bool = False
    base_version: int | None = None
    run_id: str = ""

    @staticmethod
    def new(version: int, codec: str, bucket_bytes: int, delta: bool, base: int | None, run_id=""):
        return SessionMeta(uuid.uuid4().hex, version, codec, bucket_bytes, delta, base, run_id)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> SessionMeta:
        try:
            meta = SessionMeta(**d)
        except TypeError as exc:
            raise ValueError(f"bad session metadata: {exc}") from None
        problem = _meta_problem(meta)
        if problem is not None:
            raise ValueError(f"bad session metadata: {problem}")
        return meta


def _is_int(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 1 << 62


def _meta_problem(meta: SessionMeta) -> str | None:
    """Which field of a sender's metadata has the wrong type or range, or None."""
    if not isinstance(meta.session, str) or not 0 < len(meta.session) <= 64:
        return "session must be a string of 1-64 characters"
    if not _is_int(meta.version):
        return f"version must be an integer >= 0, got {type(meta.version).__name__}"
    if not isinstance(meta.codec, str):
        return f"codec must be a codec name, got {type(meta.codec).__name__}"
    if not _is_int(meta.bucket_bytes, 1):
        return f"bucket_bytes must be an integer >= 1, got {type(meta.bucket_bytes).__name__}"
    if not isinstance(meta.delta, bool):
        return f"delta must be true or false, got {type(meta.delta).__name__}"
    if meta.base_version is not None and not _is_int(meta.base_version):
        return "base_version must be an integer >= 0 or null"
    if not isinstance(meta.run_id, str) or len(meta.run_id) > 64:
        return "run_id must be a string of <= 64 characters"
    return None


@dataclass
class Bucket:
    """``payload`` uint8 [<= bucket_bytes]; ``entries`` [key, part_total, offset, length]."""

    session: str
    index: int
    entries: list[list]
    payload: torch.Tensor
    crc: int = 0

    def header(self) -> dict:
        return {k: getattr(self, k) for k in ("session", "index", "entries", "crc")}

    def to_bytes(self) -> bytes:
        """Safetensors bytes: the payload tensor, the header in the file's metadata."""
        from safetensors.torch import save

        return save({"payload": self.payload}, metadata={"bucket": json.dumps(self.header())})

    @staticmethod
    def from_bytes(data: bytes) -> Bucket:
        from safetensors.torch import load

        try:
            n = int.from_bytes(data[:8], "little")
            header = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["bucket"])
            payload = load(data)["payload"]
            return Bucket(payload=payload, **header)
        except Exception as exc:  # any malformed input is one refusal, never a crash
            raise ValueError(
                f"bucket is not a valid safetensors bucket: {type(exc).__name__}: {exc}"
            ) from None


@dataclass
class TensorSpec:
    """One tensor in the manifest: how to rebuild it and the checksum of the result."""

    name: str
    codec: str
    parts: dict[str, list]  # part -> [dtype name, shape]
    meta: dict
    checksum: int


@dataclass
class Manifest:
    session: str
    buckets: int
    tensors: list[TensorSpec] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> Manifest:
        session, buckets, tensors = d.get("session"), d.get("buckets"), d.get("tensors")
        if not isinstance(session, str):
            raise ValueError("bad manifest: session must be a string")
        if not _is_int(buckets):
            raise ValueError("bad manifest: buckets must be an integer >= 0")
        if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
            raise ValueError("bad manifest: tensors must be a list of objects")
        try:
            specs = [TensorSpec(**t) for t in tensors]
        except TypeError as exc:
            raise ValueError(f"bad manifest: tensors: {exc}") from None
        for i, spec in enumerate(specs):
            problem = _spec_problem(spec)
            if problem is not None:
                raise ValueError(f"bad manifest: tensors[{i}].{problem}")
        return Manifest(session, buckets, specs)


def _spec_problem(spec: TensorSpec) -> str | None:
    """Which field of a manifest's tensor has the wrong type, or None."""
    if not isinstance(spec.name, str) or not isinstance(spec.codec, str):
        return "name and codec must be strings"
    parts = spec.parts
    if not isinstance(parts, dict) or not all(
        isinstance(v, list)
        and len(v) == 2
        and isinstance(v[0], str)
        and isinstance(v[1], list)
        and all(_is_int(n) for n in v[1])
        for v in parts.values()
    ):
        return "parts must map part names to [dtype name, shape]"
    if not isinstance(spec.meta, dict):
        return "meta must be an object"
    if not _is_int(spec.checksum):
        return "checksum must be an integer >= 0"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in manifest")
    return dtype


def part_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only if it was not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class BucketPacker:
    """Packs encoded tensors into buckets of ``bucket_bytes``; yields each bucket as it fills.

    Peak memory is one bucket plus the tensor being packed."""

    def __init__(self, session: str, bucket_bytes: int) -> None:
        self.session, self.size = session, bucket_bytes
        self.index, self.specs = 0, []
        self._chunks: list[torch.Tensor] = []
        self._entries: list[list] = []
        self._used = 0
        self.payload_bytes = 0

    def add(self, name: str, enc: Encoded, check: int) -> Iterator[Bucket]:
        parts = {k: [dtype_name(v.dtype), list(v.shape)] for k, v in enc.parts.items()}
        self.specs.append(TensorSpec(name, enc.codec, parts, enc.meta, check))
        for part, tensor in enc.parts.items():
            data, offset = part_bytes(tensor), 0
            while offset < data.numel() or (offset == 0 and data.numel() == 0):
                take = min(self.size - self._used, data.numel() - offset)
                key = f"{name}{PART_SEP}{part}"
                self._entries.append([key, data.numel(), offset, take])
                self._chunks.append(data[offset : offset + take])
                self._used += take
                offset += take
                if self._used >= self.size:
                    yield self._emit()
                if data.numel() == 0:
                    break

    def flush(self) -> Iterator[Bucket]:
        if self._entries:
            yield self._emit()

    def _emit(self) -> Bucket:
        payload = torch.cat(self._chunks) if self._chunks else torch.zeros(0, dtype=torch.uint8)
        bucket = Bucket(
            self.session, self.index, self._entries, payload, zlib.crc32(payload.numpy())
        )
        self.index += 1
        self.payload_bytes += payload.numel()
        self._chunks, self._entries, self._used = [], [], 0
        return bucket

    def manifest(self) -> Manifest:
        return Manifest(self.session, self.index, self.specs)
