"""Weight transfer from trainer to rollout engines, with versions."""

from rlpost.sync.inprocess import InProcessChannel, SyncStats

__all__ = ["InProcessChannel", "SyncStats"]
