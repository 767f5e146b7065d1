"""Which waiting samples join the batch next: fair shares across submissions, not FIFO.

Each submission (one ``Scheduler.submit_all``) is a queue; a free slot goes to the one with
the fewest sequences in the batch. Beside others a submission holds at most ``cap`` rows, alone
all; a ticket larger than the room joins in parts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any


class FairQueue:
    """Waiting tickets (``request.n``, ``admitted``, ``cancelled``, ``group``, ``future``) by
    submission; ``ticket.admitted`` counts the samples already taken."""

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
        return sum(t.request.n - t.admitted for t in self)

    def clear(self) -> list:
        tickets = list(self)
        self._groups.clear()
        return tickets

    def take(
        self, room: int, running: Counter, cap: int, drop: Callable
    ) -> list[tuple[Any, range]]:
        """``(ticket, samples)`` to admit into ``room`` slots, ``running[group]`` counting each
        group's sequences in the batch; cancelled tickets go to ``drop``."""
        taken: list[tuple[Any, range]] = []
        share = Counter(running)
        while room > 0 and self._groups:
            alone = len(self._groups) == 1 and not (share.keys() - self._groups.keys())
            under = [g for g in self._groups if alone or share[g] < cap]
            if not under:  # every waiting submission has its share while others run
                break
            group = min(under, key=lambda g: share[g])  # the first of the smallest shares
            queue = self._groups[group]
            ticket = queue[0]
            if ticket.cancelled or ticket.future.done():
                queue.popleft()
                if ticket.cancelled:
                    drop(ticket)
            else:
                left = ticket.request.n - ticket.admitted
                k = min(left, room, room if alone else cap - share[group])
                if taken and taken[-1][0] is ticket:  # its next part, in the same step
                    taken[-1] = (ticket, range(taken[-1][1].start, ticket.admitted + k))
                else:
                    taken.append((ticket, range(ticket.admitted, ticket.admitted + k)))
                ticket.admitted += k
                room -= k
                share[group] += k
                if k == left:
                    queue.popleft()
            if not queue:
                del self._groups[group]
        return taken
