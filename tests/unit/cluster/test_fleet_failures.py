"""The fleet under failures that overlap: two reports of one loss, a death during a resync,
preemption notices on two workers, scaling or closing while a worker restarts, a transient
sync failure, a worker restarted after a silence, restarts spent, a worker left suspect.

The workers here are scripted handles (what a host's proxy returns, minus the host), so each
interleaving is set up exactly; tests/integration/test_fleet_process.py and the Ray cases
run the same fleet over real processes and actors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlpost.cluster.fleet import RolloutFleet
from rlpost.cluster.health import HealthPolicy, State
from rlpost.errors import WorkerError
from rlpost.rollout.worker import RolloutResult

DRAINING_REFUSAL = WorkerError(
    "rollout", "draining", "rollout-0 worker, generate: received SIGTERM; taking no new ones"
)


class Scripted:
    """A rollout worker handle whose behaviour the test sets: ``dead`` (the process is gone),
    ``gen_error`` (generate raises), ``block`` (generate waits for the event)."""

    def __init__(self, index: int, start: int) -> None:
        self.index, self.start = index, start
        self.dead = False
        self.v = 0
        self.block: threading.Event | None = None
        self.push_block: threading.Event | None = None  # load_weights waits for it
        self.push_gates: list = []  # or, call by call, for the next of these (None: no wait)
        self.gen_error: Exception | None = None
        self.calls = 0

    def version(self) -> int:
        self.asked = getattr(self, "asked", 0) + 1
        if self.dead:
            raise RuntimeError("process exited")
        return self.v

    def load_weights(self, tensors, version: int) -> None:
        gate = self.push_gates.pop(0) if self.push_gates else self.push_block
        if gate is not None:
            gate.wait(30)
        if self.dead:
            raise RuntimeError("process exited")
        self.v = max(self.v, version)  # an actor runs one caller's calls in order

    def generate(self, prompts, params, n, *, train=False, last=False, min_version=None):
        self.calls += 1
        if self.block is not None:
            self.block.wait(30)
        if self.gen_error is not None:
            raise self.gen_error
        if self.dead:
            raise RuntimeError("process exited during generate")
        return RolloutResult([(self.index, p) for p in prompts], {})


class Spawner:
    def __init__(self, start_delay: float = 0.0) -> None:
        self.delay, self.handles, self.stopped = start_delay, [], []

    def start(self, index: int, old=None) -> Scripted:
        if old is not None:
            time.sleep(self.delay)
        handle = Scripted(index, sum(h.index == index for h in self.handles))
        self.handles.append(handle)
        return handle

    def alive(self, handle: Scripted) -> bool:
        return not handle.dead

    def stop(self, handle: Scripted) -> None:
        self.stopped.append(handle)


def weights():
    return [("w", torch.zeros(2))]


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions raised in the fleet's background threads."""
    errors: list = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(repr(a.exc_value)))
    return errors


def _until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _fleet(spawner, size, **policy):
    fleet = RolloutFleet(spawner, size, policy=HealthPolicy(**policy))
    fleet.load_weights(weights(), 1)
    return fleet


def test_one_loss_reported_twice_restarts_the_worker_once(thread_errors):
    spawner = Spawner(start_delay=0.3)
    fleet = _fleet(spawner, 2, suspect_after_s=30, dead_after_s=60)
    try:
        first = fleet.members[0].handle
        first.block = threading.Event()
        out: list = []
        t = threading.Thread(target=lambda: out.append(fleet.generate(list(range(6)), None, 1)))
        t.start()
        _until(lambda: first.calls == 1)
        first.dead = True
        fleet.load_weights(weights(), 2)  # the push finds it gone: the restart begins
        first.block.set()  # then its running generate fails too: the same loss again
        t.join(30)
        assert [p for _, p in out[0].groups] == list(range(6))
        _until(lambda: fleet.members[0].health.serving)
        assert fleet.members[0].handle is not first and fleet.members[0].handle.v == 2
        assert fleet.members[0].health.restarts == 1 and thread_errors == []
    finally:
        fleet.close()


def test_a_worker_that_dies_during_its_resync_is_restarted(thread_errors):
    spawner = Spawner()
    fleet = _fleet(spawner, 2)
    try:
        first = fleet.members[0].handle
        pushes = [0]

        def load_weights(tensors, version):
            pushes[0] += 1
            if pushes[0] > 1:
                first.dead = True  # the resync finds it gone
            raise RuntimeError("out of memory" if pushes[0] == 1 else "process exited")

        first.load_weights = load_weights
        fleet.load_weights(weights(), 2)  # a transient failure: stale, resynced in the background
        _until(lambda: fleet.members[0].handle is not first and fleet.members[0].health.serving)
        assert fleet.members[0].handle.v == 2 and thread_errors == []
    finally:
        fleet.close()


def test_preemption_notices_on_two_workers_do_not_fail_the_step():
    spawner = Spawner(start_delay=0.5)
    fleet = _fleet(spawner, 3, suspect_after_s=30, dead_after_s=60)
    try:
        refusal = DRAINING_REFUSAL
        fleet.members[0].handle.gen_error = refusal
        second = fleet.members[1].handle
        calls = [0]

        def generate(prompts, params, n, **kw):
            calls[0] += 1
            if calls[0] == 1:  # its running call finishes; the re-sent share is refused
                time.sleep(0.3)
                return RolloutResult([(1, p) for p in prompts], {})
            raise refusal

        second.generate = generate
        out = fleet.generate(list(range(9)), None, 1)
        assert [p for _, p in out.groups] == list(range(9))
    finally:
        fleet.close()


@pytest.mark.parametrize("finish", ["scale", "close"])
def test_scaling_down_or_closing_during_a_restart_stops_the_new_worker(finish, thread_errors):
    spawner = Spawner(start_delay=0.5)
    fleet = _fleet(spawner, 2, suspect_after_s=30, dead_after_s=60)
    fleet.members[1].handle.dead = True
    fleet.load_weights(weights(), 2)  # slot 1 lost: its restart takes 0.5 s
    _until(lambda: fleet.members[1].health.state is State.RESTARTING)
    if finish == "scale":
        fleet.scale(1)
    else:
        fleet.close()
    _until(lambda: len(spawner.handles) == 3 and not fleet.members[1].restarting)
    assert spawner.handles[2] in spawner.stopped  # started, then not needed: stopped
    fleet.close()
    assert thread_errors == []


def test_a_transient_failure_of_a_restarted_workers_first_sync_is_retried():
    spawner = Spawner()
    start = spawner.start

    def flaky_start(index, old=None):
        handle = start(index, old)
        if old is not None:
            failed = [False]
            plain = handle.load_weights

            def load_weights(tensors, version):
                if not failed[0]:
                    failed[0] = True
                    raise RuntimeError("transient")
                plain(tensors, version)

            handle.load_weights = load_weights
        return handle

    spawner.start = flaky_start
    fleet = RolloutFleet(spawner, 1, admit_timeout_s=20)
    try:
        fleet.load_weights(weights(), 1)
        fleet.members[0].handle.dead = True
        out = fleet.generate([1, 2], None, 1)
        assert [p for _, p in out.groups] == [1, 2] and fleet.states() == ["healthy"]
    finally:
        fleet.close()


def test_a_worker_restarted_after_a_silence_is_timed_afresh():
    now = [0.0]
    spawner = Spawner()
    fleet = RolloutFleet(
        spawner, 2, policy=HealthPolicy(suspect_after_s=50, dead_after_s=100), clock=lambda: now[0]
    )
    try:
        fleet.load_weights(weights(), 1)
        silent = fleet.members[0].handle
        silent.block = threading.Event()
        threading.Timer(1.2, lambda: now.__setitem__(0, now[0] + 101)).start()
        out = fleet.generate(list(range(4)), None, 1)  # worker 0 says nothing for 101 s
        silent.block.set()
        assert [p for _, p in out.groups] == list(range(4))
        _until(lambda: fleet.members[0].health.serving)
        assert silent in spawner.stopped
        back = fleet.members[0].handle

        def slow(prompts, params, n, **kw):  # slower than the fleet's poll, far within limits
            time.sleep(1.3)
            return RolloutResult([(0, p) for p in prompts], {})

        back.generate = slow
        fleet.generate(list(range(4)), None, 1)  # the clock stands still
        assert fleet.members[0].health.restarts == 1 and fleet.states() == ["healthy"] * 2
    finally:
        fleet.close()


def test_a_push_unanswered_past_dead_after_goes_on_without_that_worker(thread_errors):
    """A worker behind a partition does not answer a weight push: after ``dead_after_s`` the
    push returns with the others served, the silent one stale (no prompts for it); once it
    answers again a full sync brings it to the newest version before it serves."""
    spawner = Spawner()
    fleet = _fleet(spawner, 2, suspect_after_s=0.2, dead_after_s=0.5)
    try:
        cut = fleet.members[1].handle
        cut.push_block = threading.Event()
        start = time.monotonic()
        fleet.load_weights(weights(), 2)
        assert time.monotonic() - start < 5  # bounded by dead_after_s, not by the silence
        assert fleet.states() == ["healthy", "stale"]
        out = fleet.generate(list(range(4)), None, 1)
        assert {w for w, _ in out.groups} == {0}  # only the worker that took version 2
        fleet.load_weights(weights(), 3)  # meanwhile a newer version: the silent one misses it
        cut.push_block.set()  # the link is back
        _until(lambda: fleet.states() == ["healthy", "healthy"])
        assert cut.v == 3 and fleet.members[1].handle is cut  # synced, not restarted
        assert thread_errors == []
    finally:
        fleet.close()


def test_an_abandoned_push_answering_after_the_resync_is_no_miss(thread_errors):
    """The push that went silent returns only after the full sync gave the worker a newer
    version; the worker reporting that newer version has missed nothing and stays admitted."""
    spawner = Spawner()
    fleet = _fleet(spawner, 2, suspect_after_s=0.2, dead_after_s=0.5)
    try:
        cut = fleet.members[1].handle
        late, sync = threading.Event(), threading.Event()
        cut.push_gates = [late, sync, None]  # the push of version 2, then the resync's
        fleet.load_weights(weights(), 2)  # silent past dead_after_s: stale, a resync starts
        fleet.load_weights(weights(), 3)
        sync.set()  # the resync lands first (version 2, then 3)
        _until(lambda: fleet.states() == ["healthy", "healthy"] and cut.v == 3)
        asked = cut.asked
        late.set()  # then the abandoned push of version 2 answers
        _until(lambda: cut.asked > asked)
        time.sleep(0.2)
        assert fleet.states() == ["healthy", "healthy"] and thread_errors == []
    finally:
        fleet.close()


def test_a_worker_retired_with_its_restarts_spent_is_stopped():
    spawner = Spawner()
    fleet = _fleet(spawner, 2, max_restarts=0, max_failures=1)
    try:
        broken = fleet.members[0].handle
        broken.gen_error = RuntimeError("CUDA error: an illegal memory access")  # alive, broken
        out = fleet.generate(list(range(4)), None, 1)
        assert [p for _, p in out.groups] == list(range(4))
        _until(lambda: fleet.states()[0] == "retired")
        _until(lambda: broken in spawner.stopped)
    finally:
        fleet.close()


def test_a_suspect_worker_that_takes_weights_serves_again():
    spawner = Spawner()
    fleet = _fleet(spawner, 2)
    try:
        flaky = fleet.members[0].handle
        flaky.gen_error = RuntimeError("transient")
        fleet.generate(list(range(4)), None, 1)
        assert fleet.states() == ["suspect", "healthy"]
        flaky.gen_error = None
        fleet.load_weights(weights(), 2)
        assert fleet.states() == ["healthy", "healthy"]
        before = flaky.calls
        fleet.generate(list(range(4)), None, 1)
        assert flaky.calls == before + 1
    finally:
        fleet.close()


def test_a_failed_start_stops_the_workers_that_did_start():
    spawner = Spawner()
    start = spawner.start

    def third_fails(index, old=None):
        if index == 2:
            raise RuntimeError("no GPU left")
        return start(index, old)

    spawner.start = third_fails
    with pytest.raises(RuntimeError, match="no GPU left"):
        RolloutFleet(spawner, 3)
    assert sorted(h.index for h in spawner.stopped) == [0, 1]


def test_the_fleet_acts_on_the_kind_never_on_the_words():
    """A refusal is known by its kind: a plain error whose text reads like one is a failed
    call (the worker turns suspect), a ``draining`` WorkerError drains the worker."""
    spawner = Spawner()
    fleet = _fleet(spawner, 3, suspect_after_s=30, dead_after_s=60)
    try:
        words, typed = fleet.members[0].handle, fleet.members[1].handle
        plain = words.generate

        def once(prompts, params, n, **kw):
            words.generate = plain  # fails once, then serves
            raise RuntimeError("WorkerDraining: received SIGTERM (words only)")

        words.generate = once
        typed.gen_error = DRAINING_REFUSAL
        out = fleet.generate(list(range(9)), None, 1)
        assert [p for _, p in out.groups] == list(range(9))
        history = [[e.state for e in m.health.history] for m in fleet.members]
        assert State.SUSPECT in history[0] and State.DRAINING not in history[0]
        assert State.DRAINING in history[1] and State.SUSPECT not in history[1]
    finally:
        fleet.close()


def test_each_workers_seconds_and_the_resent_shares_are_in_the_stats():
    """A slow worker shows as the largest per-worker seconds; a failed share is counted."""
    fleet = _fleet(Spawner(), 3, suspect_after_s=30, dead_after_s=60)
    try:
        slow = fleet.members[1].handle
        fast_generate = slow.generate

        def generate(*args, **kw):
            time.sleep(0.3)
            return fast_generate(*args, **kw)

        slow.generate = generate
        fleet.members[2].handle.gen_error = RuntimeError("connection reset")
        out = fleet.generate(list(range(9)), None, 1)
        assert [p for _, p in out.groups] == list(range(9))
        seconds = {k: v for k, v in out.stats.items() if k.startswith("rollout_seconds_worker")}
        assert max(seconds, key=seconds.get) == "rollout_seconds_worker1", seconds
        assert out.stats["rollout_resent"] == 1
    finally:
        fleet.close()
