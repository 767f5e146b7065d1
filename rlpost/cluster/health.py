"""The health of one rollout worker, as pure logic: states, events, an injected clock.

::

    healthy --a call fails / no reply for suspect_after_s--> suspect
    suspect --a call succeeds--> healthy
    suspect --another failure / no reply for dead_after_s--> dead
    healthy, suspect --the worker is lost (process gone)--> dead
    healthy, suspect --preemption notice--> draining --its calls are re-sent--> dead
    dead --restarts left--> restarting --up again--> stale
    dead --no restarts left--> retired
    stale --full weight sync, reports the current version--> healthy
    healthy --misses a weight version--> stale
    any --scaled down--> retired

Only a ``healthy`` worker is given prompts. The fleet (:mod:`rlpost.cluster.fleet`) reports
events and asks what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class State(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"
    RESTARTING = "restarting"
    STALE = "stale"
    DRAINING = "draining"
    RETIRED = "retired"


# Every transition the machine allows; anything else is a bug in the caller.
ALLOWED: dict[State, set[State]] = {
    State.HEALTHY: {State.SUSPECT, State.DEAD, State.STALE, State.DRAINING, State.RETIRED},
    State.SUSPECT: {State.HEALTHY, State.DEAD, State.STALE, State.DRAINING, State.RETIRED},
    State.DRAINING: {State.DEAD, State.RETIRED},
    State.DEAD: {State.RESTARTING, State.RETIRED},
    State.RESTARTING: {State.STALE, State.DEAD, State.RETIRED},
    State.STALE: {State.HEALTHY, State.DEAD, State.DRAINING, State.RETIRED},
    State.RETIRED: set(),
}


class IllegalTransition(ValueError):
    """The caller asked for a transition the machine does not have."""


@dataclass(frozen=True)
class HealthPolicy:
    """When a silent worker is suspect or dead, how many failures and restarts it gets."""

    suspect_after_s: float = 60.0
    dead_after_s: float = 600.0
    max_failures: int = 2  # consecutive failed calls (not losses) before it is dead
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.suspect_after_s <= self.dead_after_s:
            raise ValueError("need 0 < suspect_after_s <= dead_after_s")
        if self.max_failures < 1 or self.max_restarts < 0:
            raise ValueError("need max_failures >= 1 and max_restarts >= 0")


@dataclass(frozen=True)
class Event:
    at: float
    state: State
    why: str


@dataclass
class WorkerHealth:
    """One worker's state. ``clock`` returns seconds (``time.monotonic`` unless injected)."""

    policy: HealthPolicy = field(default_factory=HealthPolicy)
    clock: Callable[[], float] = time.monotonic
    state: State = State.STALE  # a new worker serves nothing until it is synced
    restarts: int = 0
    failures: int = 0
    version: int | None = None  # the weight version it last reported
    busy_since: float | None = None  # a call is outstanding since
    history: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append(Event(self.clock(), self.state, "created"))

    @property
    def serving(self) -> bool:
        """May be given new prompts."""
        return self.state is State.HEALTHY

    @property
    def alive(self) -> bool:
        """Is (or may soon be) able to work: not dead, draining or retired."""
        return self.state in (State.HEALTHY, State.SUSPECT, State.STALE, State.RESTARTING)

    def _to(self, state: State, why: str) -> None:
        if state is self.state:
            return
        if state not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {state.value} ({why})")
        self.state = state
        if state not in (State.HEALTHY, State.SUSPECT):
            self.busy_since = None  # its calls are over: a later one is timed from its start
        self.history.append(Event(self.clock(), state, why))

    def call_started(self) -> None:
        if self.busy_since is None:
            self.busy_since = self.clock()

    def succeeded(self) -> None:
        """A call returned: the worker is responsive."""
        self.busy_since = None
        self.failures = 0
        if self.state is State.SUSPECT:
            self._to(State.HEALTHY, "replied")

    def responded(self, why: str) -> None:
        """It answered something other than a generate call (a weight push): responsive, but
        a call still outstanding stays timed."""
        self.failures = 0
        if self.state is State.SUSPECT:
            self._to(State.HEALTHY, why)

    def failed(self, why: str) -> None:
        """A call raised (the worker is still there): suspect, then dead after max_failures."""
        self.busy_since = None
        self.failures += 1
        if self.state not in (State.HEALTHY, State.SUSPECT, State.STALE):
            return
        if self.failures >= self.policy.max_failures:
            self._to(State.DEAD, why)
        elif self.state is State.HEALTHY:
            self._to(State.SUSPECT, why)

    def lost(self, why: str) -> None:
        """The worker is gone (its process died, its actor is unreachable)."""
        self.busy_since = None
        if self.state in (State.DEAD, State.RETIRED, State.RESTARTING):
            return  # already known (a second report of the same loss)
        self._to(State.DEAD, why)

    def drain(self, why: str = "preemption notice") -> None:
        """It will go away soon: take no new prompts; its unfinished ones go elsewhere."""
        if self.state in (State.HEALTHY, State.SUSPECT, State.STALE):
            self._to(State.DRAINING, why)

    def drained(self) -> None:
        if self.state is State.DRAINING:
            self._to(State.DEAD, "drained")

    def check(self) -> State:
        """Time-based transitions: a call outstanding for too long makes it suspect, then dead."""
        if self.busy_since is not None and self.state in (State.HEALTHY, State.SUSPECT):
            silent = self.clock() - self.busy_since
            if silent >= self.policy.dead_after_s:
                self._to(State.DEAD, f"no reply for {silent:.0f} s")
            elif silent >= self.policy.suspect_after_s and self.state is State.HEALTHY:
                self._to(State.SUSPECT, f"no reply for {silent:.0f} s")
        return self.state

    def begin_restart(self) -> bool:
        """A dead worker restarts if it has restarts left (True), else it is retired (False)."""
        if self.state is not State.DEAD:
            raise IllegalTransition(f"restart from {self.state.value}")
        if self.restarts >= self.policy.max_restarts:
            self._to(State.RETIRED, f"{self.restarts} restarts spent")
            return False
        self.restarts += 1
        self.failures = 0
        self._to(State.RESTARTING, f"restart {self.restarts}/{self.policy.max_restarts}")
        return True

    def restart_failed(self, why: str) -> None:
        """The new worker did not come up: dead again (another restart, if any are left)."""
        if self.state is State.RESTARTING:
            self._to(State.DEAD, why)

    def started(self) -> None:
        """The restarted worker is up; it serves nothing before a full weight sync."""
        self._to(State.STALE, "up, weights not synced")
        self.version = None

    def synced(self, reported: int, current: int) -> bool:
        """After a full sync the worker reported ``reported``; it is admitted only if that is
        ``current`` (True)."""
        self.version = reported
        if reported == current and self.state is State.STALE:
            self._to(State.HEALTHY, f"serves version {current}")
            return True
        return self.state is State.HEALTHY and reported == current

    def missed(self, current: int, why: str) -> None:
        """It did not take weight version ``current``: stale until a full sync."""
        if self.state in (State.HEALTHY, State.SUSPECT):
            self._to(State.STALE, f"missed version {current}: {why}")

    def retire(self, why: str) -> None:
        self._to(State.RETIRED, why)
