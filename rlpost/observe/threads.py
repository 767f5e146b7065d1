"""``run.threads=0`` during a run: the torch threads follow the cores other work leaves free.

:func:`rlpost.observe.mfu.pick_threads` samples once, so a moment of load could keep a run on
one thread; :class:`ThreadFollower` re-checks after every step from the kernel's counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rlpost.observe import mfu
from rlpost.observe.mfu import _allowed_cpus, _cpu_times, _usable_cores, busy_cpus

MARGIN = 0.25
"""CPUs past the half-way point the free cores must move before the count changes, so a load
at a rounding boundary does not flip it every step."""


def follow_threads(current: int, cores: int, others_busy: float, margin: float = MARGIN) -> int:
    """The thread count after a step: ``cores - others_busy`` rounded, within 1..cores, but
    ``current`` kept unless the free cores moved more than ``0.5 + margin`` away from it."""
    if current < 1 or cores < 1:
        raise ValueError(f"threads and cores must be >= 1, got {current} and {cores}")
    free = cores - max(0.0, others_busy)
    if abs(free - current) <= 0.5 + margin:
        return min(current, cores)
    return max(1, min(cores, round(free)))


def _say(line: str) -> None:
    print(line, flush=True)


def _sample():
    # process_time: every thread of this process, user + system
    return time.perf_counter(), time.process_time(), _cpu_times(_allowed_cpus())


class ThreadFollower:
    """Re-checks the load after every step and sets the loop thread's torch threads; other load
    is the CPUs busy over the step minus this process's CPU time."""

    def __init__(self, set_threads: Callable[[int], None], current: int, say=_say, **probe):
        """``probe`` (tests): ``cores`` and ``sample``, a callable returning wall seconds,
        this process's CPU seconds and the ``/proc/stat`` jiffies (None off Linux)."""
        self.set_threads, self.current, self.say = set_threads, current, say
        self.cores = probe.get("cores") or _usable_cores()
        self._sample = probe.get("sample", _sample)
        self.changes = 0
        self._mark = self._sample()

    def after_step(self) -> int:
        """The count for the next step (changed, and said in one line, when the load moved)."""
        (w0, p0, c0), (w1, p1, c1) = self._mark, self._sample()
        self._mark = (w1, p1, c1)
        if c0 is None or c1 is None or w1 - w0 <= 0:
            return self.current  # no /proc/stat (not Linux): the start decision stands
        others = max(0.0, busy_cpus(c0, c1, self.cores) - (p1 - p0) / (w1 - w0))
        new = follow_threads(self.current, self.cores, others)
        if new != self.current:
            self.say(
                f"rlpost: run.threads=0: {self.current} -> {new} threads "
                f"({others:.1f} of {self.cores} cores busy with other work over the last step)",
            )
            self.set_threads(new)
            self.current, self.changes = new, self.changes + 1
        return new


def start_threads(
    requested: int, set_threads: Callable[[int], None], say=_say
) -> ThreadFollower | None:
    """Set the threads of ``run.threads`` at the start of a run; for 0 also say in one line
    what was chosen and why, and return the follower that re-checks after each step."""
    threads = mfu.pick_threads(requested)
    set_threads(threads)
    if requested:
        return None
    cores, busy = mfu._AUTO_WHY or [_usable_cores(), 0.0]
    say(
        f"rlpost: run.threads=0 -> {threads} thread{'s' if threads != 1 else ''} "
        f"({int(cores)} usable cores, {busy:.1f} busy with other work); re-checked after every step"
    )
    return ThreadFollower(set_threads, threads, say)


class CoreShare:
    """The trainer's threads beside a rollout process: ``base`` while it runs a call, ``base +
    lend`` while not, switched by :func:`pace` (two OpenMP teams on a core wait each other)."""

    def __init__(self, busy, base: int, lend: int, set_threads: Callable[[int], None]):
        if base < 1 or lend < 0:
            raise ValueError(f"base must be >= 1 and lend >= 0, got {base} and {lend}")
        self.busy, self.base, self.lend, self.set_threads = busy, base, lend, set_threads
        self._set = threading.local()  # a thread's count is its own (an OpenMP setting)
        self.switches = 0

    def pace(self) -> int:
        """Set the calling thread's count for the rollout process's state now; returns it."""
        want = self.base if self.busy.value > 0 else self.base + self.lend
        if getattr(self._set, "threads", None) != want:
            self.set_threads(want)
            self._set.threads = want
            self.switches += 1
        return want


_SHARE: list[CoreShare] = []


def share_cores(share: CoreShare | None) -> None:
    """Install (or with None remove) this process's :class:`CoreShare`."""
    _SHARE[:] = [share] if share is not None else []


def pace() -> None:
    """Between chunks of the trainer's passes: take or hand back the cores of
    :class:`CoreShare`; nothing when none is installed."""
    if _SHARE:
        _SHARE[0].pace()
