"""The ``disk`` channel: a versioned directory of safetensors buckets, for any number of readers.

Layout under the channel's root (local or shared storage)::

    v0000000007/bucket-000000.safetensors ...   one file per bucket (header in its metadata)
    v0000000007/session.json                    session metadata and manifest
    LATEST                                      "7": the marker, written last

A version is written into a hidden temporary directory, renamed into place,
and only then is ``LATEST`` written to a temporary file and renamed over the
old one; both renames are atomic on POSIX, so a reader sees either the old
version or the whole new one, never a half-written one. A sender that dies
leaves only a temporary directory, which the next session removes. Readers
(:func:`load_latest`) rebuild the version through a
:class:`~rlpost.sync.receiver.Receiver`, which checks every bucket CRC and
tensor checksum. Readers are anonymous, so the sender cannot know their base
version: delta is not offered on this channel. The newest ``KEEP`` versions
stay on disk so a reader that is mid-way through one is not cut off.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlpost.statefile import atomic_write, clear
from rlpost.sync.receiver import CommitReport, Receiver
from rlpost.sync.session import Bucket, Manifest, SessionMeta, SyncError

MARKER = "LATEST"
KEEP = 2


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:010d}"


class DiskTransport:
    """Writes sessions under ``root``; ``finish`` publishes the version atomically."""

    supports_delta = False

    def __init__(self, root, options) -> None:
        self.root = Path(root)
        self.target = str(self.root)
        self.tmp: Path | None = None
        self.meta: SessionMeta | None = None

    def start(self, meta: SessionMeta) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            self.tmp = self.root / f".tmp-{meta.session}"
            self.tmp.mkdir()
        except OSError as exc:
            raise SyncError(
                "start", self.target, f"cannot create the version directory: {exc}"
            ) from None
        self.meta = meta

    def update(self, bucket: Bucket) -> None:
        if self.tmp is None:
            raise SyncError("update", self.target, "no session started")
        path = self.tmp / f"bucket-{bucket.index:06d}.safetensors"
        try:
            path.write_bytes(bucket.to_bytes())
        except OSError as exc:
            raise SyncError("update", self.target, f"cannot write {path.name}: {exc}") from None

    def finish(self, manifest: Manifest) -> CommitReport:
        if self.tmp is None or self.meta is None:
            raise SyncError("finish", self.target, "no session started")
        version = self.meta.version
        body = {"meta": self.meta.to_json(), "manifest": manifest.to_json()}
        try:
            (self.tmp / "session.json").write_text(json.dumps(body))
            final = version_dir(self.root, version)
            clear(final)  # the same version written again (a retried step)
            os.replace(self.tmp, final)
            with atomic_write(self.root / MARKER, "w") as fh:
                fh.write(str(version))
        except OSError as exc:
            raise SyncError(
                "finish", self.target, f"cannot publish version {version}: {exc}"
            ) from None
        self.tmp = None
        self._prune(version)
        size = sum(p.stat().st_size for p in final.glob("bucket-*.safetensors"))
        return CommitReport(version, {}, 0.0, size, served=False)

    def _prune(self, latest: int) -> None:
        versions = sorted(self.root.glob("v" + "[0-9]" * 10))
        for old in versions[:-KEEP]:
            if int(old.name[1:]) < latest:
                shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def close(self) -> None:
        self.abort()


def latest_version(root) -> int | None:
    """The version the marker names, or None when nothing was published yet."""
    try:
        return int((Path(root) / MARKER).read_text().strip())
    except FileNotFoundError:
        return None


def load_latest(root, receiver: Receiver) -> CommitReport | None:
    """Commit the newest published version into ``receiver`` unless it already serves it: a
    higher version of its run id, or any version of a new run id (a resume or rollback
    publishes lower numbers under a new one, and readers follow)."""
    version = latest_version(root)
    if version is None:
        return None
    run_id = _published_meta(Path(root), version).run_id
    if run_id == receiver.run_id and version <= receiver.version:
        return None
    return load_version(root, version, receiver)


def _published_meta(root: Path, version: int) -> SessionMeta:
    try:
        body = json.loads((version_dir(root, version) / "session.json").read_text())
        return SessionMeta.from_json(body["meta"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SyncError("start", str(root), f"cannot read version {version}: {exc}") from None


def load_version(root, version: int, receiver: Receiver) -> CommitReport:
    """Commit published ``version`` into ``receiver`` (a restore may name an older one)."""
    folder = version_dir(Path(root), version)
    try:
        body = json.loads((folder / "session.json").read_text())
    except (OSError, ValueError) as exc:
        raise SyncError(
            "start", receiver.name, f"cannot read {folder}/session.json: {exc}"
        ) from None
    meta, manifest = SessionMeta.from_json(body["meta"]), Manifest.from_json(body["manifest"])
    receiver.start(meta)
    for i in range(manifest.buckets):
        path = folder / f"bucket-{i:06d}.safetensors"
        try:
            data = path.read_bytes()
        except OSError as exc:
            receiver.abort()
            raise SyncError("update", receiver.name, f"cannot read {path}: {exc}") from None
        receiver.update(Bucket.from_bytes(data))
    return receiver.finish(manifest)
