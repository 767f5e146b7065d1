"""A rollout fleet: N rollout workers behind the one rollout-worker interface the loop drives.

The fleet splits each ``generate`` call's prompts over the workers that are
``healthy`` (:mod:`rlpost.cluster.health`), calls them concurrently and returns
the groups in prompt order. A worker that dies or fails mid-call loses nothing:
its share of the prompts is sent again to the others, so the step completes
with every prompt answered exactly once (a prompt's groups come from exactly
one worker's reply). The lost worker is restarted in the background, at most
``max_restarts`` times; before it gets a prompt it receives the newest weights
in full and must report their version. New weights go to every admitted
worker; one that misses a version is ``stale`` and is synced the same way.
Each call carries the version last sent, and a worker holding an older one
refuses it: one its host restarted between calls (Ray does this on its own)
is found stale, synced and readmitted, its share re-sent, and never samples
from old weights.

It is generic over worker handles: anything with the rollout worker's methods
(a :class:`~rlpost.cluster.process.ProcessWorker`, a Ray actor proxy, a plain
``RolloutWorker``). A :class:`Spawner` starts them; ``alive(handle)`` tells a
lost worker from one whose call raised. Every state change is one JSON line in
``<run_dir>/cluster_events.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from rlpost.cluster.health import HealthPolicy, State, WorkerHealth
from rlpost.errors import WorkerError, kind_of, typed_line
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.worker import RolloutResult
from rlpost.statefile import atomic_write
from rlpost.types import Prompt

SCALE_REQUEST = "scale.json"  # in <run_dir>/cluster: {"rollout": N, "id": ...}
FLEET_STATE = "fleet.json"  # in <run_dir>/cluster: the fleet after the last request
JOB_JOIN_S = 30.0  # at close: the longest a background restart is waited for


class Spawner(Protocol):
    def start(self, index: int, old: Any | None = None) -> Any:
        """A ready worker handle for slot ``index`` (``old``: the lost one it replaces)."""

    def alive(self, handle: Any) -> bool:
        """False once the handle's worker is gone for good (the handle's own ``alive()``)."""
        return handle.alive()

    def stop(self, handle: Any) -> None:
        """Close (or kill) the worker."""

    def cancel(self) -> None:
        """The fleet is closing: a start still waiting gives up soon (raises)."""


@dataclass
class Member:
    index: int
    handle: Any
    health: WorkerHealth
    logged: int = 0  # health events already written
    restarting: bool = False
    served: int = 0  # prompts answered


@dataclass
class Chunk:
    start: int  # index of its first prompt in the call
    prompts: list[Prompt]
    failures: list[str] = field(default_factory=list)


class RolloutFleet:
    """The rollout worker interface (``RolloutAPI``) over a fleet of rollout workers."""

    def __init__(
        self,
        spawner: Spawner,
        size: int,
        *,
        policy: HealthPolicy | None = None,
        events: Path | None = None,
        admit_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        control: Path | None = None,
    ) -> None:
        self.spawner = spawner
        self.policy = policy or HealthPolicy()
        self.events_path = events
        self.admit_timeout_s = admit_timeout_s
        self.clock = clock
        self._lock = threading.Condition()
        self._latest: tuple[list, int] | None = None  # the newest weights, kept for restarts
        self._version = 0
        self._closed = False
        self._jobs: list[threading.Thread] = []  # restarts and full syncs in the background
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * size), thread_name_prefix="fleet")
        self.members: list[Member] = []
        starts = [self._pool.submit(spawner.start, i) for i in range(size)]
        wait(starts)
        failed = [f.exception() for f in starts if f.exception() is not None]
        if failed:  # the ones that did start are stopped: nothing outlives a failed start
            for f in starts:
                if f.exception() is None:
                    self._stop_quietly(f.result())
            self._pool.shutdown(wait=False)
            raise failed[0]
        handles = [f.result() for f in starts]
        for i, handle in enumerate(handles):
            self.members.append(Member(i, handle, WorkerHealth(self.policy, clock)))
            self._log(self.members[-1])
        self._version = int(handles[0].version()) if handles else 0
        self.control = control
        if control is not None:
            control.mkdir(parents=True, exist_ok=True)
            threading.Thread(target=self._watch, name="fleet-control", daemon=True).start()

    def _log(self, m: Member, **extra) -> None:
        new = m.health.history[m.logged :]
        m.logged = len(m.health.history)
        if self.events_path is None or not new:
            return
        with self.events_path.open("a") as f:
            for e in new:
                row = {"time": time.time(), "worker": m.index, "state": e.state.value, "why": e.why}
                f.write(json.dumps(row | {"version": m.health.version} | extra) + "\n")

    def states(self) -> list[str]:
        with self._lock:
            return [m.health.state.value for m in self.members]

    def serving(self) -> list[Member]:
        with self._lock:
            return [m for m in self.members if m.health.serving]

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        *,
        train: bool = False,
        last: bool = False,
    ) -> RolloutResult:
        """``n`` samples per prompt from the healthy workers; the groups come back in prompt
        order (per worker share: a worker may order its own share by predicted length)."""
        todo = [Chunk(0, list(prompts))] if prompts else []
        done: dict[int, list] = {}
        stats: list[dict[str, float]] = []
        took: dict[str, float] = {"rollout_resent": 0.0}  # per worker: its slowest share
        kw, why = dict(train=train, last=last), ""
        while todo:
            workers = self._await_serving()
            chunks = _split(todo, len(workers))
            todo = []
            running: dict[Future, tuple[Member, Chunk, Any]] = {}
            with self._lock:
                floor = self._version if self._latest is not None else None
            for k, chunk in enumerate(chunks):
                m = workers[k % len(workers)]  # more shares than workers: a re-send left gaps
                m.health.call_started()
                call = partial(m.handle.generate, **kw, min_version=floor)
                fut = self._pool.submit(_timed, call, chunk.prompts, params, n)
                running[fut] = (m, chunk, m.handle)
            while running:
                finished, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in finished:
                    m, chunk, handle = running.pop(fut)
                    try:
                        result = fut.result()
                    except Exception as exc:  # re-sent below; a real bug fails twice and is raised
                        kind = kind_of(exc)
                        if handle is not m.handle or kind == "draining":
                            # a replaced worker's call, or a refusal after a preemption notice:
                            # nothing wrong with the share; it goes to another worker
                            self._failed(m, exc, handle)
                        elif kind == "behind":  # restarted behind our back: sync, then serve
                            self._behind(m, exc)
                        else:
                            chunk.failures.append(typed_line(exc))
                            self._failed(m, exc, handle)
                            if len(chunk.failures) >= 2 and not _is_loss(self.spawner, handle):
                                raise WorkerError(
                                    "rollout",
                                    "failed",
                                    f"rollout failed on two workers: {chunk.failures[-1]}",
                                ) from exc
                        todo.append(chunk)
                        took["rollout_resent"] += 1
                        continue
                    with self._lock:
                        if handle is m.handle:
                            m.health.succeeded()
                            self._log(m)
                        m.served += len(chunk.prompts)
                    result, seconds = result
                    key = f"rollout_seconds_worker{m.index}"
                    took[key] = max(took.get(key, 0.0), seconds)
                    done[chunk.start] = result.groups
                    stats.append(result.stats)
                    why = why or result.why
                for fut, (m, chunk, handle) in list(running.items()):
                    with self._lock:
                        state = m.health.check() if handle is m.handle else State.DEAD
                        self._log(m)
                    if state is State.DEAD:  # silent too long: abandon it, re-send its share
                        running.pop(fut)
                        chunk.failures.append("no reply")
                        self._later(m, self._restart, True)  # stopping it may take a while
                        todo.append(chunk)
                        took["rollout_resent"] += 1
        groups = [g for start in sorted(done) for g in done[start]]
        return RolloutResult(groups, {**_merge_stats(stats), **took}, why)

    def _await_serving(self) -> list[Member]:
        """The healthy workers; waits for a restart to finish when none is left."""
        deadline = self.clock() + self.admit_timeout_s
        with self._lock:
            while True:
                workers = [m for m in self.members if m.health.serving]
                # no healthy worker: the suspect ones still work (a reply clears them)
                workers = workers or [
                    m for m in self.members if m.health.state is State.SUSPECT and not m.restarting
                ]
                if workers:
                    return workers
                coming = [m for m in self.members if m.restarting or m.health.alive]
                if not coming or self._closed:
                    raise WorkerError(
                        "rollout", "lost", f"no rollout worker left ({self._why_gone()})"
                    )
                if self.clock() >= deadline:
                    raise WorkerError(
                        "rollout",
                        "timeout",
                        f"no rollout worker became healthy within {self.admit_timeout_s:.0f} s "
                        f"({self._why_gone()})",
                    )
                self._lock.wait(timeout=1.0)

    def _why_gone(self) -> str:
        last = [(m.index, m.health.history[-1]) for m in self.members]
        return "; ".join(f"worker {i} {e.state.value}: {e.why}" for i, e in last)

    def _failed(self, m: Member, exc: BaseException, handle: Any = None) -> None:
        """Record a failed call of ``m`` (made on ``handle``: a report about a worker that has
        since been replaced changes nothing)."""
        why = typed_line(exc)
        handle = m.handle if handle is None else handle
        with self._lock:
            if handle is not m.handle:
                return
            if kind_of(exc) == "draining":
                m.health.drain(why)
                m.health.drained()
            elif _is_loss(self.spawner, handle):
                m.health.lost(why)
            else:
                m.health.failed(why)
            self._log(m)
            dead = m.health.state is State.DEAD
        if dead:
            self._later(m, self._restart)

    def _behind(self, m: Member, exc: BaseException) -> None:
        """A worker refused a call for holding older weights: stale until a full sync."""
        with self._lock:
            m.health.succeeded()  # it replied: responsive, only behind
            m.health.missed(self._version, typed_line(exc))
            self._log(m)
        self._later(m, self._admit_marked)

    def _later(self, m: Member, job, *args) -> None:
        """``job(m, *args)`` (:meth:`_restart`, or :meth:`_admit_marked`'s full weight sync) in
        a thread of its own, ``m`` marked ``restarting`` until it ends; nothing when it already
        is marked or the fleet is closed."""
        with self._lock:
            if m.restarting or self._closed:
                return
            m.restarting = True
        name = f"fleet{job.__name__}-{m.index}"
        thread = threading.Thread(target=job, args=(m, *args), name=name, daemon=True)
        self._jobs.append(thread)
        thread.start()

    def _stop_quietly(self, handle: Any) -> None:
        with contextlib.suppress(Exception):  # a worker already gone: nothing left to release
            self.spawner.stop(handle)

    def _restart(self, m: Member, stop_old: bool = False) -> None:
        try:
            if stop_old:
                self._stop_quietly(m.handle)
            while True:
                with self._lock:
                    if self._closed or m.health.state is not State.DEAD:
                        return
                    old = m.handle
                    spent = not m.health.begin_restart()
                    self._log(m)
                if spent:  # retired: its worker, if still running, is stopped
                    self._stop_quietly(old)
                    return
                try:
                    handle = self.spawner.start(m.index, old)
                except Exception as exc:
                    with self._lock:
                        m.health.restart_failed(f"restart failed: {typed_line(exc)}")
                        self._log(m)
                    continue
                with self._lock:
                    wanted = not self._closed and m.health.state is State.RESTARTING
                    if wanted:
                        m.handle = handle
                        m.health.started()
                        self._log(m)
                if not wanted:  # closed or scaled down while it started: not needed
                    self._stop_quietly(handle)
                    return
                if self._admit(m):
                    return
        finally:
            with self._lock:
                m.restarting = False
                self._lock.notify_all()

    def _admit(self, m: Member) -> bool:
        """Full weight sync until the worker reports the newest version; then it serves (True).
        A failed sync is tried again until the failures make the worker dead (False)."""
        while True:
            with self._lock:
                latest, handle = self._latest, m.handle
                if m.health.state is not State.STALE or self._closed:
                    return m.health.state is State.HEALTHY
            if latest is None:  # nothing pushed yet: the first load_weights admits it
                with self._lock:
                    if self._latest is None:
                        return True
                continue
            tensors, version = latest
            try:
                handle.load_weights(tensors, version)
                reported = int(handle.version())
            except Exception as exc:
                self._failed(m, exc, handle)
                continue  # still stale: once more; dead: the loop's check returns False
            with self._lock:
                if self._latest is not None and self._latest[1] != version:
                    continue  # newer weights arrived during the sync: send those
                m.health.synced(reported, version)
                self._log(m, current=version)
                self._lock.notify_all()
                return m.health.state is State.HEALTHY

    def load_weights(self, named_tensors, version: int) -> None:
        """Serve these weights on every admitted worker; keep a copy for later admissions."""
        tensors = [(name, t.detach().clone()) for name, t in named_tensors]
        with self._lock:
            self._latest = (tensors, version)
            self._version = version
            takes = (State.HEALTHY, State.SUSPECT, State.STALE)
            targets = [m for m in self.members if not m.restarting and m.health.state in takes]
        futures = {self._pool.submit(self._push, m, tensors, version): m for m in targets}
        _, silent = wait(futures, timeout=self.policy.dead_after_s)
        for fut in silent:  # no reply past dead_after_s: the step goes on without it
            m, why = futures[fut], f"no reply for {self.policy.dead_after_s:g} s"
            with self._lock:
                m.health.missed(version, why)
                self._log(m)
            self._later(m, self._admit_marked)  # a full sync once it answers, or a restart
        if not self.serving() and not any(m.restarting for m in self.members):
            raise WorkerError(
                "rollout",
                "lost",
                f"no rollout worker took weights version {version} ({self._why_gone()})",
            )

    def _push(self, m: Member, tensors: list, version: int) -> None:
        handle = m.handle
        try:
            handle.load_weights(tensors, version)
            reported = int(handle.version())
        except Exception as exc:
            with self._lock:
                if handle is not m.handle:
                    return  # replaced meanwhile: its restart syncs the new one
                m.health.missed(version, typed_line(exc))
            self._failed(m, exc, handle)
        else:
            with self._lock:
                if handle is not m.handle:
                    return
                if m.health.state is State.STALE:  # the newest version, if a push was abandoned
                    m.health.synced(reported, self._version)
                elif reported < version:  # an abandoned push may return after a newer one
                    m.health.missed(version, f"reports version {reported}")
                else:
                    m.health.responded(f"took version {version}")
                self._log(m, current=version)
                self._lock.notify_all()
        if m.health.state is State.STALE:  # still there: a full sync readmits it
            self._later(m, self._admit_marked)

    def _admit_marked(self, m: Member) -> None:
        """:meth:`_admit` for a worker marked ``restarting``; the mark goes when it is done,
        and a worker that died during the sync is restarted."""
        try:
            self._admit(m)
        finally:
            with self._lock:
                m.restarting = False
                dead = m.health.state is State.DEAD
                self._lock.notify_all()
            if dead:
                self._later(m, self._restart)

    def version(self) -> int:
        return self._version

    def served_checksum(self) -> int | None:
        """The first serving worker's weights checksum (None when none can say)."""
        for m in self.members:
            if not m.restarting and m.health.state is State.HEALTHY:
                return m.handle.served_checksum()
        return None

    def drain(self, index: int, why: str = "preemption notice") -> None:
        """Give worker ``index`` no new prompts; what it runs now finishes or is re-sent."""
        with self._lock:
            m = self.members[index]
            m.health.drain(why)
            self._log(m)

    def scale(self, size: int) -> None:
        """Grow to or shrink to ``size`` live workers. New ones are synced before they serve;
        removed ones (the newest first) finish nothing new and are stopped."""
        with self._lock:
            live = [m for m in self.members if m.health.state is not State.RETIRED]
        for _ in range(size - len(live)):
            with self._lock:
                index = len(self.members)
            handle = self.spawner.start(index)
            m = Member(index, handle, WorkerHealth(self.policy, self.clock))
            with self._lock:
                self.members.append(m)
                self._log(m)
                m.restarting = True
            self._admit_marked(m)
        for m in reversed(live[size:]):
            with self._lock:
                m.health.retire(f"scaled down to {size}")
                self._log(m)
            self.spawner.stop(m.handle)

    def _watch(self) -> None:
        """Serve scale requests written to ``control/scale.json`` (``rlpost cluster scale``)
        and report the fleet in ``control/fleet.json`` after each."""
        request, seen = self.control / SCALE_REQUEST, None
        self._report(None, "")
        while not self._closed:
            time.sleep(0.5)
            self._report(None, "", only_changed=True)
            try:
                stamp = request.stat().st_mtime_ns
                if stamp == seen:
                    continue
                seen = stamp
                ask = json.loads(request.read_text())
                size, ident = int(ask["rollout"]), str(ask.get("id", ""))
                if size < 1:
                    raise ValueError(f"rollout={size}: at least one rollout worker")
            except FileNotFoundError:
                continue
            except (ValueError, KeyError, TypeError) as exc:  # a bad request is answered, not fatal
                self._report(None, f"bad scale request: {exc}")
                continue
            try:
                self.scale(size)
                self._report(ident, "")
            except Exception as exc:  # reported to the caller; the run goes on with what it has
                self._report(ident, typed_line(exc))

    def _report(self, ident: str | None, error: str, *, only_changed: bool = False) -> None:
        with self._lock:
            rows = [
                {"worker": m.index, "state": m.health.state.value, "version": m.health.version}
                for m in self.members
            ]
            now = (rows, self._version, self._closed)
            if only_changed and now == getattr(self, "_reported", None):
                return
            self._reported = now
            body = dict(id=ident, error=error, version=self._version, workers=rows)
            body["running"] = not self._closed
        with atomic_write(self.control / FLEET_STATE, "w") as fh:
            fh.write(json.dumps(body))

    def _each(self, name: str, *args) -> dict[int, Any]:
        """``name(*args)`` of every serving worker, by index (a failed call is recorded)."""
        out = {}
        for m in self.serving():
            try:
                out[m.index] = getattr(m.handle, name)(*args)
            except Exception as exc:
                self._failed(m, exc)
        return out

    def throughput(self) -> float:
        return float(sum(self._each("throughput").values()))

    def reset_stats(self) -> None:
        self._each("reset_stats")

    def state_dict(self) -> dict[str, Any]:
        """Each slot's sampling stream and length statistics (a restarted slot starts afresh)."""
        return {"fleet": self._each("state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each live slot's saved state (a resume loads it before the first weight sync)."""
        per = state.get("fleet")
        with self._lock:
            live = [m for m in self.members if m.health.alive and not m.restarting]
        for m in live:
            one = state if per is None else per.get(m.index, per.get(str(m.index)))
            if one is not None:
                m.handle.load_state_dict(one)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        # a restart still waiting on its worker (a lost node) must end before this process
        # does: a thread left inside the cluster client when the interpreter exits crashes it
        getattr(self.spawner, "cancel", lambda: None)()
        for job in self._jobs:
            job.join(timeout=JOB_JOIN_S)
        for m in self.members:
            if m.health.state is not State.RETIRED:
                self._stop_quietly(m.handle)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.control is not None:
            self._report(None, "")  # the job's last word: running false


def _split(chunks: list[Chunk], parts: int) -> list[Chunk]:
    """The prompts of ``chunks`` in ``parts`` contiguous shares of near-equal size (each share
    keeps the index of its first prompt in the call, so the replies reassemble in order)."""
    flat = [(c.start + i, p) for c in chunks for i, p in enumerate(c.prompts)]
    flat.sort(key=lambda x: x[0])
    out: list[Chunk] = []
    parts = max(1, min(parts, len(flat)))
    size, extra = divmod(len(flat), parts)
    at = 0
    for k in range(parts):
        take = flat[at : at + size + (1 if k < extra else 0)]
        at += len(take)
        # a re-sent share's prompts are contiguous in the call only within one old chunk;
        # split at gaps so every share is one contiguous run of the call's prompts
        run: list = []
        for idx, p in take:
            if run and idx != run[-1][0] + 1:
                out.append(Chunk(run[0][0], [q for _, q in run]))
                run = []
            run.append((idx, p))
        if run:
            out.append(Chunk(run[0][0], [q for _, q in run]))
    prior = {c.start: c.failures for c in chunks}
    for c in out:
        c.failures = list(prior.get(c.start, []))
    return out


def _is_loss(spawner: Spawner, handle: Any) -> bool:
    try:
        return not spawner.alive(handle)
    except Exception:  # cannot even ask: treat as gone
        return True


def _timed(call: Callable, *args: Any) -> tuple[Any, float]:
    """``call(*args)`` and the seconds it took."""
    start = time.monotonic()
    return call(*args), time.monotonic() - start


def _merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """Counts add up; fractions average."""
    out: dict[str, float] = {}
    for key in {k for s in stats for k in s}:
        values = [s[key] for s in stats if key in s]
        out[key] = sum(values) if key.startswith("carried_") else sum(values) / len(values)
    return out
