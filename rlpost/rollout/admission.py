"""Which waiting requests join the batch next: fair shares across submissions, not FIFO.

First come, first served lets one submission of 1024 prompts x n 64 hold every
slot until it is done while a request of one prompt, sent a moment later,
waits behind all of it. Here each submission (one ``Scheduler.submit_all``
call: one HTTP request) is a queue of its own, and a free slot goes to the
submission with the fewest sequences in the batch (ties: the one that came
first), so a small request joins at the next step boundary however large the
requests ahead of it. Within a submission the order is kept. A ticket that does
not fit in the room left is not skipped over by others (that would starve
large ``n``); it waits for room, and takes the whole batch when alone.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any


class FairQueue:
    """Waiting tickets (anything with ``request.n``, ``cancelled`` and ``group``) by submission."""

    def __init__(self) -> None:
        self._groups: dict[int, deque] = {}  # insertion order is arrival order
        self._next = 0

    def push(self, tickets: Iterable[Any]) -> int:
        """Queue one submission's tickets; they share a new group id (returned, set on each)."""
        group, self._next = self._next, self._next + 1
        queue = deque(tickets)
        for ticket in queue:
            ticket.group = group
        if queue:
            self._groups[group] = queue
        return group

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self):
        return (t for queue in self._groups.values() for t in queue)

    def sequences(self) -> int:
        return sum(t.request.n for t in self)

    def clear(self) -> list:
        tickets = list(self)
        self._groups.clear()
        return tickets

    def take(self, room: int, running: Counter, batch_busy: bool, drop: Callable) -> list:
        """Tickets to admit into ``room`` free slots; ``running[group]`` counts each group's
        sequences in the batch, ``batch_busy`` whether any run. Cancelled tickets met on the
        way are removed and passed to ``drop``."""
        taken: list = []
        share = Counter(running)
        while self._groups:
            group = min(self._groups, key=lambda g: share[g])  # first of the smallest share
            queue = self._groups[group]
            ticket = queue[0]
            if ticket.cancelled:
                queue.popleft()
                drop(ticket)
            elif ticket.request.n > room and (batch_busy or taken):
                break
            else:
                taken.append(queue.popleft())
                room -= ticket.request.n
                share[group] += ticket.request.n
            if not queue:
                del self._groups[group]
        return taken
