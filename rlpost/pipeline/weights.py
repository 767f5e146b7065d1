"""The run's weight path: the one object that moves the trainer's weights to rollout.

Built once per run (:func:`build_weight_path`, its kind follows from the config alone)
and owned by the loop and its feed; every push goes through it: the starting weights,
each step's update, a restore (resume, rollback), a guard's re-send and the weights an
evaluation must see. :class:`DirectPath` hands the trainer's tensors over as they are (a
rollout fleet fans them out itself); :class:`ChannelPath` runs a
:class:`~rlpost.sync.WeightSync` (codecs, buckets, delta, verification) into the rollout
worker, to ``rlpost serve`` or ``vllm serve`` over http (``rollout.engine=remote``),
into a directory that servers and workers load (``sync.channel=disk``), or over
torch.distributed to a rollout worker in another process (``sync.channel=gloo``: this
process is rank 0 of a group on 127.0.0.1, the worker rank 1).

Its counts are the wire truth: ``sync_bytes`` is what the push sent (the
encoded payload, summed over targets), and the loop's step metrics, hence
``rl_weight_sync_bytes_total``, are built from :meth:`WeightPath.take_sent`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

from rlpost.sync import SyncError, WeightSync, build_weight_sync
from rlpost.sync.codecs import CODECS


class WeightPath(Protocol):
    """Moves one export (``tensors``, ``version``, ``bytes``) to the rollout side."""

    def push(self, export) -> dict[str, float]:
        """Serve ``export`` now; its sync metrics (``sync_seconds``, ``sync_bytes``...)."""
        ...

    def take_sent(self) -> float:
        """Bytes pushed since the last call (every push counts, whoever asked for it)."""
        ...

    def restart_versions(self) -> None:
        """The trainer's versions start again (a restore): readers must follow, not ignore."""
        ...

    def close(self) -> None: ...


class _Counter:
    def __init__(self) -> None:
        self._sent = 0.0
        self._lock = threading.Lock()  # a producer thread pushes while the trainer reads

    def count(self, nbytes: float) -> None:
        with self._lock:
            self._sent += nbytes

    def take_sent(self) -> float:
        with self._lock:
            sent, self._sent = self._sent, 0.0
        return sent


class DirectPath(_Counter):
    """The trainer's tensors straight into the rollout worker (its own copy; no codec)."""

    def __init__(self, rollout) -> None:
        super().__init__()
        self.rollout = rollout

    def push(self, export) -> dict[str, float]:
        start = time.perf_counter()
        self.rollout.load_weights(export.tensors, export.version)
        self.count(float(export.bytes))
        return {"sync_seconds": time.perf_counter() - start, "sync_bytes": float(export.bytes)}

    def close(self) -> None:
        """Nothing of its own to release (nor to tell on a restore: the copy lands whatever
        its number)."""

    restart_versions = close


class ChannelPath(_Counter):
    """A :class:`WeightSync` over ``sync.channel``; ``served`` (remote servers) is told
    the version and which targets committed, so rollout routes around the others."""

    def __init__(self, sync: WeightSync, served=None) -> None:
        super().__init__()
        self.sync, self.served = sync, served

    def push(self, export) -> dict[str, float]:
        try:
            stats = self.sync.push(export.tensors, export.version)
        except SyncError:
            if self.served is not None:
                self.served(export.version, [], [t.target for t in self.sync.transports])
            raise
        self.count(float(stats.bytes))
        if self.served is not None:
            self.served(export.version, stats.committed, list(stats.failed))
        return {k: float(v) for k, v in stats.metrics().items()}

    def restart_versions(self) -> None:
        self.sync.restart_versions()

    def close(self) -> None:
        self.sync.close()


def build_weight_path(cfg, rollout, run_dir=None) -> WeightPath:
    """The weight path of ``cfg`` (the whole config: the sync, rollout and engine keys)
    into ``rollout`` (the rollout worker, a fleet, or a proxy of either). The disk channel
    publishes under ``run_dir/weights``."""
    s = cfg.sync
    if cfg.rollout.engine.name == "remote" and cfg.rollout.engine.server == "vllm":
        from rlpost.rollout.engines.vllm_server import build_sync

        return ChannelPath(build_sync(cfg), served=lambda *told: rollout.weights_served(*told))
    if cfg.rollout.engine.name == "remote":
        from rlpost.rollout.engines.client import keys_from_env

        e = cfg.rollout.engine
        admin = keys_from_env(e.api_key_env, e.admin_key_env)["admin_key"]
        headers = {"Authorization": f"Bearer {admin}"} if admin else None
        http = type(s).model_validate({**dict(s), "channel": "http"})  # servers: over HTTP
        sync = build_weight_sync(http, list(cfg.rollout.engine.servers), headers=headers)
        return ChannelPath(sync, served=lambda *told: rollout.weights_served(*told))
    if s.channel.name == "disk":
        if run_dir is None:
            raise ValueError("sync.channel=disk publishes under the run directory; none given")
        root = str(Path(run_dir) / "weights")
        return ChannelPath(build_weight_sync(s, [root]), served=_disk_reader(rollout, root, s))
    if s.channel.name == "gloo":
        from rlpost.sync.gloo import GlooLink
        from rlpost.train.dp import free_port

        link = GlooLink("127.0.0.1", free_port(), world_size=2)
        rollout.join_gloo(link, 1, s.verify, s.timeout_s)
        return ChannelPath(build_weight_sync(s, [link]))
    if CODECS.trait(s.codec.name, "identity") and not s.delta:
        return DirectPath(rollout)
    return ChannelPath(build_weight_sync(s, [rollout]))


def _disk_reader(rollout, root: str, s):
    """After a version is published, the rollout worker (in any process that sees the
    directory) loads it from there."""

    def served(version: int, committed: list[str], failed: list[str]) -> None:
        if committed:
            rollout.load_published(root, version, s.verify)

    return served
