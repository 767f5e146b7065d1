"""Where a step's rollout comes from: generated on the spot, or by a producer running ahead.

* :class:`SyncFeed` (``pipeline.mode=sync``) runs the rollout stage when asked.
* :class:`OverlapFeed` (``one_step_off`` and ``async``) runs it on a producer thread while
  the trainer trains. Staleness is bounded by admission (AReaL, SkyRL): batch ``j`` starts
  once the engine serves version ``j - eta`` or newer. A group still past the bound is
  trained with the importance weight (``pipeline.stale=wait``) or dropped and resampled.

Both checkpoint the prompts drawn but not yet trained (``pending``), so every prompt trains
exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from rlpost.data import PromptSampler
from rlpost.errors import one_line
from rlpost.pipeline.stages import RolloutOutput, RolloutSettings, rollout_stage
from rlpost.pipeline.weights import DirectPath, WeightPath
from rlpost.pipeline.workers import RewardAPI, RolloutAPI
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.types import Group, Prompt


class RolloutFailed(RuntimeError):
    """The rollout side stopped (its worker died or raised); the message says why in one line."""


class PromptSource:
    """The sampler's batches after any handed back; ``take``: what was drawn since last."""

    def __init__(self, sampler: PromptSampler, pending: list[list[Prompt]] | None = None) -> None:
        self.sampler = sampler
        self.pending: deque[list[Prompt]] = deque(pending or [])
        self._drawn: list[list[Prompt]] = []
        self._lock = threading.Lock()  # the producer draws while the trainer gives back

    def next_batch(self) -> list[Prompt]:
        with self._lock:
            batch = self.pending.popleft() if self.pending else self.sampler.next_batch()
            self._drawn.append(batch)
        return batch

    def take(self) -> list[list[Prompt]]:
        with self._lock:
            drawn, self._drawn = self._drawn, []
        return drawn

    def give_back(self, batches: list[list[Prompt]]) -> None:
        """Batches to generate again before anything new (in their order)."""
        with self._lock:
            self.pending.extendleft(reversed(batches))

    def waiting(self) -> list[list[Prompt]]:
        with self._lock:
            return list(self.pending)

    def untaken(self) -> list[list[Prompt]]:
        """Batches drawn but not yet taken by a finished rollout (one that failed part way)."""
        with self._lock:
            return list(self._drawn)


@dataclass
class Fed:
    """One step's input: the scored groups, how long the trainer waited, what was dropped."""

    out: RolloutOutput
    stats: dict[str, float] = field(default_factory=dict)


class _Feed:
    """What both feeds hold: the workers, the prompt source, the sampling, the weight path."""

    def __init__(
        self,
        rollout: RolloutAPI,
        reward: RewardAPI,
        source: PromptSource,
        params: SamplingParams,
        settings: RolloutSettings,
        weights: WeightPath | None = None,
    ) -> None:
        self.rollout, self.reward, self.source = rollout, reward, source
        self.params, self.settings = params, settings
        self.path = weights or DirectPath(rollout)

    def _rollout(self, source, last: bool) -> RolloutOutput:
        return rollout_stage(
            self.rollout, self.reward, source, self.params, self.settings, last=last
        )


class SyncFeed(_Feed):
    """Generate each step's rollout when the trainer asks (``pipeline.mode=sync``)."""

    def next(self, step: int, version: int, last: bool) -> Fed:
        out = self._rollout(self.source, last)
        self.source.take()
        return Fed(out)

    def push(self, export, *, report: bool = True) -> dict[str, float]:
        """Serve the trainer's new weights now; returns sync metrics (``report=False``: a
        re-send, counted in the next report)."""
        m = self.path.push(export)
        return {**m, "sync_bytes": self.path.take_sent()} if report else {}

    def pending(self) -> list[list[Prompt]]:
        """Batches drawn but not trained: a rollout that failed part way (a lost worker)
        leaves its batch drawn, and a resume generates it first."""
        return self.source.untaken() + self.source.waiting()

    def pause(self) -> None:
        """Nothing runs in the background: the engine already serves the newest weights."""

    resume = close = pause


class OverlapFeed(_Feed):
    """A producer thread runs the rollout stage ahead of the trainer, within ``eta`` versions."""

    def __init__(
        self,
        rollout: RolloutAPI,
        reward: RewardAPI,
        source: PromptSource,
        params: SamplingParams,
        settings: RolloutSettings,
        *,
        eta: int,
        queue_batches: int,
        stale: str,
        first_step: int,
        version: int,
        total_steps: int,
        defer_weights: bool = False,
        weights: WeightPath | None = None,
    ) -> None:
        super().__init__(rollout, reward, source, params, settings, weights)
        self.eta, self.queue_batches, self.stale = eta, queue_batches, stale
        self.total_steps = total_steps
        self.defer_weights = defer_weights
        self._cond = threading.Condition()
        self.admitted = first_step  # index of the next rollout batch (= the step that trains it)
        self.version = version  # what the engine serves
        self.ready: deque[tuple[int, RolloutOutput, list[list[Prompt]]]] = deque()
        self.in_flight: list[list[Prompt]] = []
        self.error: BaseException | None = None
        self.rollout_wait = 0.0
        self.weights = None  # deferred weights, applied before the next batch starts
        self._stop = False
        self._paused = False
        self._idle = False
        self._thread = threading.Thread(target=self._produce, name="rlpost-rollout", daemon=True)
        self._thread.start()

    def _admissible(self) -> bool:
        if self._stop:
            return True
        if self._paused:
            return False
        return self.weights is not None or (
            self.admitted - self.version <= self.eta and len(self.ready) < self.queue_batches
        )

    def _produce(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cond:
                    self._idle = True
                    self._cond.notify_all()
                    self._cond.wait_for(self._admissible)
                    self._idle = False
                    if self._stop or self.admitted >= self.total_steps:
                        return
                    weights, self.weights = self.weights, None
                    if weights is None:
                        j = self.admitted
                        self.admitted += 1
                    self.rollout_wait += time.perf_counter() - t0
                if weights is not None:  # between two batches: no sample mixes versions
                    self.path.push(weights)
                    self.synced(weights.version)
                    continue
                out = self._rollout(self._recording(), last=j + 1 >= self.total_steps)
                with self._cond:
                    self.ready.append((j, out, self.source.take()))
                    self.in_flight = []
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the trainer's thread, which reports it
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _recording(self):
        feed = self

        class Recording:
            def next_batch(self) -> list[Prompt]:
                batch = feed.source.next_batch()
                with feed._cond:
                    feed.in_flight.append(batch)
                return batch

        return Recording()

    def next(self, step: int, version: int, last: bool) -> Fed:
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self.ready or self.error is not None)
            if self.error is not None and not self.ready:
                raise RolloutFailed(one_line(self.error)) from self.error
            j, out, _ = self.ready.popleft()
            queued = len(self.ready)
            in_flight = self.admitted - j - 1 - queued
            rollout_wait, self.rollout_wait = self.rollout_wait, 0.0
            self._cond.notify_all()
        stats = {
            "trainer_wait_seconds": time.perf_counter() - t0,
            "rollout_wait_seconds": rollout_wait,
            "rollout_batches_queued": float(queued),
            "rollout_batches_in_flight": float(max(in_flight, 0)),
        }
        out, dropped = self._bound(out, version)
        if dropped:
            self.source.give_back([[g.prompt for g in dropped]])
        stats["stale_dropped"] = float(sum(g.n for g in dropped))
        return Fed(out, stats)

    def _bound(self, out: RolloutOutput, version: int) -> tuple[RolloutOutput, list[Group]]:
        """Split off the groups whose oldest token is more than ``eta`` versions old."""
        if self.stale != "drop":
            return out, []
        keep, drop = [], []
        for g in out.groups:
            oldest = min(min(c.versions_per_token(), default=version) for c in g.completions)
            (drop if version - oldest > self.eta else keep).append(g)
        if not keep:  # never train on nothing: the oldest group trains, corrected
            keep, drop = drop[:1], drop[1:]
        out.groups = keep
        return out, drop

    def push(self, export, *, report: bool = True) -> dict[str, float]:
        """New weights from the trainer; returns sync metrics (``report=False``: a re-send,
        counted in the next report)."""
        start, m = time.perf_counter(), {}
        if self.defer_weights:
            tensors = [(name, t.detach().clone()) for name, t in export.tensors]
            with self._cond:
                self.weights = replace(export, tensors=tensors)
                self._cond.notify_all()
        else:
            m = self.path.push(export)
            self.synced(export.version)
        if not report:
            return {}
        return {
            **m,
            "sync_seconds": time.perf_counter() - start,
            "sync_bytes": self.path.take_sent(),
        }

    def synced(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def pending(self) -> list[list[Prompt]]:
        """Prompt batches drawn but not yet trained: queued outputs' and the one in flight."""
        with self._cond:
            batches = [b for _, _, drawn in self.ready for b in drawn] + list(self.in_flight)
        return batches + self.source.waiting()

    def pause(self) -> None:
        """Let the batch in flight finish, start no other, and serve the newest weights
        (held-out evaluation then measures exactly the trained policy)."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._idle or not self._thread.is_alive())
            weights, self.weights = self.weights, None
        if weights is not None:
            self.path.push(weights)
            self.synced(weights.version)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop producing; the engine is left serving the newest weights."""
        self.pause()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
