"""Ctrl-C and SIGTERM during a run: stop cleanly, keep everything, say how to resume.

The first SIGINT or SIGTERM sets :attr:`Interrupts.stop`: the loop finishes its step and
checkpoints; a second abandons at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import signal
import sys
import threading

_active: Interrupts | None = None


class Interrupts:
    """Context manager installing the SIGINT / SIGTERM handlers (main thread only)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        global _active
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        _active = None

    def _handle(self, signum, frame) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt
        self.signum = signum
        self.stop.set()
        print(
            f"\nrlpost: {signal.Signals(signum).name}: stopping after the current step and saving "
            "a checkpoint; send it again to stop at once",
            file=sys.stderr,
        )

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process stopped by it."""
        return 128 + (self.signum or signal.SIGINT)


def stop_requested() -> bool:
    """True once a stop signal reached the active handler (False when none is installed)."""
    return _active is not None and _active.stop.is_set()


def request_stop(why: str) -> bool:
    """Stop the run as the first SIGTERM would, for a notice another process got; False
    without a handler."""
    active = _active
    if active is None or active.stop.is_set():
        return False
    active.signum = signal.SIGTERM
    active.stop.set()
    print(
        f"\nrlpost: {why}: stopping after the current step and saving a checkpoint", file=sys.stderr
    )
    return True
