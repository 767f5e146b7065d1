"""Every worker in this process: plain objects, plain calls, ``breakpoint()`` works."""

from __future__ import annotations

from rlpost.pipeline.loop import start_workers as start_local_workers

__all__ = ["start_local_workers"]
