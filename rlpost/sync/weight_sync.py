"""The sending side: encode once, stream buckets to every target, verify what they serve.

    sync = build_weight_sync(cfg.sync, targets)   # engines, URLs, a directory...
    stats = sync.push(model.named_parameters(), version)

One pass: each tensor is encoded, packed into ``bucket_bytes`` buckets, each sent to every
target at once. A target whose delta base differs gets the full encoding; a failing target
is dropped with a reason in ``stats.failed``, and the push raises only when none committed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rlpost.errors import typed_line
from rlpost.sync.codecs import CODECS, DEFAULT_KEEP_BF16, Encoded, decode, encode
from rlpost.sync.delta import encode_delta
from rlpost.sync.session import (
    BucketPacker,
    DeltaRefused,
    Manifest,
    SessionMeta,
    SyncError,
    checksum,
)
from rlpost.sync.transports import Transport, TransportOptions, make_transport

MB = 1 << 20


@dataclass
class SyncStats:
    """One push. ``bytes``: bucket payload bytes sent, summed over targets (0 when none)."""

    version: int
    seconds: float
    bytes: int
    pause_seconds: float = 0.0
    buckets: int = 0
    delta_tensors: int = 0
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The step's sync keys for ``Recorder.record`` (``sync_bytes`` feeds rl_weight_sync_bytes_total)."""
        return {
            "sync_seconds": self.seconds,
            "sync_bytes": self.bytes,
            "sync_pause_seconds": self.pause_seconds,
            "sync_version": self.version,
        }


@dataclass
class _Group:
    """Targets sent the same encoding (delta, or full) in one push."""

    meta: SessionMeta
    targets: list[Transport]
    packer: BucketPacker


class WeightSync:
    """Pushes versions of named tensors to ``transports``; see the module docstring."""

    def __init__(
        self,
        transports: Sequence[Transport],
        *,
        codec: str = "none",
        bucket_bytes: int = 64 * MB,
        delta: bool = False,
        delta_full_threshold: float = 0.3,
        keep_bf16: Sequence[str] = DEFAULT_KEEP_BF16,
        verify: bool = True,
    ) -> None:
        if not transports:
            raise ValueError("weight sync needs at least one target")
        if delta and not all(t.supports_delta for t in transports):
            raise ValueError(
                "sync.codec.delta=true needs receivers that acknowledge versions; the disk channel cannot"
            )
        self.transports = list(transports)
        names = [t.target for t in self.transports]
        for i, t in enumerate(self.transports):
            if names.count(t.target) > 1:  # e.g. two engines of one class: keep errors apart
                t.target = f"{t.target}#{i}"
        self.codec, self.bucket_bytes, self.delta = codec, int(bucket_bytes), delta
        self.run_id = uuid.uuid4().hex  # SessionMeta.run_id; restart_versions() draws anew
        self.threshold, self.keep_bf16, self.verify = delta_full_threshold, tuple(keep_bf16), verify
        self.base_version: int | None = None
        self._base: dict[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(self.transports))

    @torch.no_grad()
    def restart_versions(self) -> None:
        """The next push starts a new line of versions (a restore reuses numbers): a new run
        id, and no delta base, so readers follow it instead of ignoring "older" versions."""
        self.run_id = uuid.uuid4().hex
        self._base, self.base_version = {}, None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Send ``named_tensors`` as ``version`` to every target; raises SyncError if none took it."""
        start = time.perf_counter()
        failed: dict[str, str] = {}
        groups = self._start(version, failed)
        expected: dict[str, int] = {}
        new_base: dict[str, torch.Tensor] = {}
        delta_tensors = 0
        try:
            for name, tensor in named_tensors:
                encs = self._encode(name, tensor, groups, new_base)
                expected[name] = self._expected(name, encs[0], new_base)
                delta_tensors += CODECS.trait(encs[0].codec, "needs_base")
                for g, enc in zip(groups, encs, strict=True):
                    if g.targets:  # a group nobody is left in packs nothing
                        self._send_all(g, g.packer.add(name, enc, expected[name]), failed)
        except BaseException:  # the caller's tensors failed: close the sessions, then raise
            for g in groups:
                for t in g.targets:
                    t.abort()
            raise
        reports = {}
        for g in groups:
            self._send_all(g, g.packer.flush(), failed)
            reports.update(self._finish(g, failed))
        self._check(reports, expected, failed)
        committed = [t for t in reports if t not in failed]
        if not committed:
            raise SyncError("push", "every target", next(iter(failed.values()), "no target"))
        if self.delta:
            self._base, self.base_version = new_base, version
        return SyncStats(
            version=version,
            seconds=time.perf_counter() - start,
            bytes=sum(g.packer.payload_bytes * len(g.targets) for g in groups),
            pause_seconds=max((reports[t].pause_seconds for t in committed), default=0.0),
            buckets=max((g.packer.index for g in groups), default=0),
            delta_tensors=delta_tensors,
            committed=committed,
            failed=failed,
        )

    def _start(self, version: int, failed: dict[str, str]) -> list[_Group]:
        """Start a session on every target: the delta group first, then those needing full."""
        base = self.base_version if self.delta and self._base else None
        metas = [
            SessionMeta.new(version, self.codec, self.bucket_bytes, self.delta, base, self.run_id)
        ]
        if base is not None:
            metas.append(
                SessionMeta.new(version, self.codec, self.bucket_bytes, True, None, self.run_id)
            )
        answers = self._each(self.transports, lambda t: t.start(metas[0]))
        members: list[list[Transport]] = [[] for _ in metas]
        for t, exc in zip(self.transports, answers, strict=True):
            if isinstance(exc, DeltaRefused) and len(metas) > 1:
                members[1].append(t)
            elif exc is None:
                members[0].append(t)
            else:
                failed[t.target] = str(exc)
        if len(metas) > 1 and members[1]:
            for t, exc in zip(
                members[1], self._each(members[1], lambda t: t.start(metas[1])), strict=True
            ):
                if exc is not None:
                    failed[t.target] = str(exc)
            members[1] = [t for t in members[1] if t.target not in failed]
        return [
            _Group(m, ts, BucketPacker(m.session, self.bucket_bytes))
            for m, ts in zip(metas, members, strict=True)
        ]

    def _encode(
        self, name: str, tensor: torch.Tensor, groups: list[_Group], new_base: dict
    ) -> list[Encoded]:
        if not self.delta:
            return [encode(name, tensor, self.codec, self.keep_bf16)] * len(groups)
        full = encode(name, tensor, self.codec)  # the bit-pattern codec the delta is taken on
        data = full.parts["data"]
        # a bf16 tensor encodes to itself: copy, or the next step changes the base
        new_base[name] = (
            data.clone()
            if data.untyped_storage().data_ptr() == (tensor.untyped_storage().data_ptr())
            else data
        )
        if groups[0].meta.base_version is None:
            return [full]
        return [encode_delta(full.parts["data"], self._base.get(name), self.threshold), full]

    def _expected(self, name: str, enc: Encoded, new_base: dict) -> int:
        """Checksum of the tensor the receiver will rebuild (lossy codecs: their decoded value)."""
        if CODECS.trait(enc.codec, "needs_base"):
            return checksum(new_base[name])
        if CODECS.trait(enc.codec, "exact"):
            return checksum(enc.parts["data"])
        return checksum(decode(enc))

    def _send_all(self, g: _Group, buckets, failed: dict[str, str]) -> None:
        for bucket in buckets:
            live = [t for t in g.targets if t.target not in failed]
            for t, exc in zip(live, self._each(live, lambda t, b=bucket: t.update(b)), strict=True):
                if exc is not None:
                    failed[t.target] = str(exc)
                    t.abort()

    def _finish(self, g: _Group, failed: dict[str, str]) -> dict:
        live = [t for t in g.targets if t.target not in failed]
        manifest: Manifest = g.packer.manifest()
        results = list(
            self._pool.map(lambda t: _attempt(t.finish, manifest, target=t.target), live)
        )
        reports = {}
        for t, (report, exc) in zip(live, results, strict=True):
            if exc is not None:
                failed[t.target] = str(exc)
            else:
                reports[t.target] = report
        return reports

    def _check(self, reports: dict, expected: dict[str, int], failed: dict[str, str]) -> None:
        """``sync.verify``: every target must report the checksum of every tensor sent."""
        if not self.verify:
            return
        for target, report in reports.items():
            if not report.served:
                continue  # a published disk version: its readers check the manifest
            for name, want in expected.items():
                got = report.checksums.get(name)
                if got != want:
                    why = f"tensor {name!r} served with checksum {got}, sent {want}"
                    failed[target] = str(SyncError("verify", target, why))
                    break

    def _each(self, transports: list[Transport], fn) -> list[Exception | None]:
        return [
            exc for _, exc in self._pool.map(lambda t: _attempt(fn, t, target=t.target), transports)
        ]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.transports:
            t.close()


def _attempt(fn, *args, target: str = "a target"):
    """``(result, None)`` or ``(None, error)``: one target's failure must not stop the others
    (an error that is not a SyncError, such as a malformed reply, is one too, in one line)."""
    try:
        return fn(*args), None
    except SyncError as exc:
        return None, exc
    except Exception as exc:
        return None, SyncError("transport", target, typed_line(exc))


def build_weight_sync(
    sync_cfg, targets: Sequence, *, headers: dict[str, str] | None = None
) -> WeightSync:
    """A :class:`WeightSync` for ``sync_cfg`` (a SyncConfig) and its targets.

    ``targets`` per ``sync_cfg.channel``: engines, URLs, directories or
    :class:`~rlpost.sync.gloo.GlooLink`; ``headers`` go with every http request."""
    options = TransportOptions(
        verify=sync_cfg.verify, timeout_s=sync_cfg.timeout_s, headers=headers
    )
    transports = [make_transport(sync_cfg.channel.name, t, options) for t in targets]
    return WeightSync(
        transports,
        codec=sync_cfg.codec.name,
        bucket_bytes=int(sync_cfg.bucket_mb * MB),
        verify=sync_cfg.verify,
        **sync_cfg.codec.params(),  # bf16's delta and its threshold, a lossy codec's keep_bf16
    )
