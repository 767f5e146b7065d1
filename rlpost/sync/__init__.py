"""Weight transfer from trainer to rollout engines: codecs, buckets, transports, versions.

The sender calls :func:`build_weight_sync` once and ``push(named_tensors, version)`` after
each update; a :class:`Receiver` wraps any engine (docs/sync.md).
"""

from rlpost.sync.codecs import codec_names
from rlpost.sync.receiver import CommitReport, Receiver
from rlpost.sync.session import DeltaRefused, SyncError
from rlpost.sync.transports import TRANSPORTS, TransportOptions, make_transport
from rlpost.sync.weight_sync import SyncStats, WeightSync, build_weight_sync

__all__ = [
    "TRANSPORTS",
    "CommitReport",
    "DeltaRefused",
    "Receiver",
    "SyncError",
    "SyncStats",
    "TransportOptions",
    "WeightSync",
    "build_weight_sync",
    "codec_names",
    "make_transport",
]
