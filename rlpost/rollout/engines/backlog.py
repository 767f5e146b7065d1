"""A stream's events between the batch and its client, bounded.

Decoding does not wait for a client; past a bound of unread events the stream's samples leave
the batch, so a stalled reader holds no slot.
"""

from __future__ import annotations

import asyncio

# Decode steps of all its samples a blocked stream (its buffers full) may fall behind.
BACKLOG_STEPS = 4
BACKLOG_MIN_EVENTS = 64


def backlog_limit(samples: int) -> int:
    """Events a stream of ``samples`` samples may have waiting while its response is blocked."""
    return max(BACKLOG_MIN_EVENTS, BACKLOG_STEPS * samples)


class Backlog:
    """One stream's events not yet bytes; past ``limit`` while ``blocked``, ``on_overflow``
    runs once and :attr:`OVERFLOW` is queued."""

    OVERFLOW = object()  # the queue's marker: the stream fell behind

    def __init__(self, limit: int, on_overflow) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.limit, self.on_overflow = limit, on_overflow
        self.blocked = False  # the response is waiting on the client
        self.overflowed = False

    def put(self, item) -> None:
        """On the event loop: queue ``item``; overflow when the client is too far behind."""
        self.queue.put_nowait(item)
        if self.blocked and not self.overflowed and self.queue.qsize() > self.limit:
            self.overflowed = True
            self.on_overflow()
            self.queue.put_nowait(self.OVERFLOW)
