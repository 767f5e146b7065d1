"""The rollout worker health state machine, driven by a hand-set clock (no workers, no Ray)."""

from __future__ import annotations

import pytest

from rlpost.cluster.health import (
    ALLOWED,
    HealthPolicy,
    IllegalTransition,
    State,
    WorkerHealth,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _healthy(policy=None, clock=None) -> WorkerHealth:
    h = WorkerHealth(policy or HealthPolicy(), clock or Clock())
    assert h.state is State.STALE and not h.serving  # new: serves nothing before a sync
    assert h.synced(0, 0)
    assert h.state is State.HEALTHY and h.serving
    return h


def test_full_cycle_healthy_dead_restarting_stale_healthy():
    clock = Clock()
    h = _healthy(HealthPolicy(max_restarts=2), clock)
    h.lost("process exited (code -9)")
    assert h.state is State.DEAD and not h.serving
    assert h.begin_restart() and h.state is State.RESTARTING and h.restarts == 1
    h.started()
    assert h.state is State.STALE and h.version is None and not h.serving
    # reports an old version after its sync: still not admitted
    assert not h.synced(3, 4) and h.state is State.STALE
    assert h.synced(4, 4) and h.state is State.HEALTHY and h.version == 4
    states = [e.state for e in h.history]
    assert states == [
        State.STALE,
        State.HEALTHY,
        State.DEAD,
        State.RESTARTING,
        State.STALE,
        State.HEALTHY,
    ]


def test_restarts_are_bounded_then_retired():
    h = _healthy(HealthPolicy(max_restarts=1))
    h.lost("gone")
    assert h.begin_restart()
    h.started()
    h.synced(1, 1)
    h.lost("gone again")
    assert not h.begin_restart()
    assert h.state is State.RETIRED and not h.alive
    with pytest.raises(IllegalTransition):
        h.begin_restart()


def test_failures_make_it_suspect_then_dead_and_a_reply_clears_them():
    h = _healthy(HealthPolicy(max_failures=2))
    h.failed("ValueError: bad")
    assert h.state is State.SUSPECT and not h.serving and h.alive
    h.succeeded()
    assert h.state is State.HEALTHY and h.failures == 0
    h.failed("once")
    h.failed("twice")
    assert h.state is State.DEAD


def test_silence_while_busy_is_suspect_then_dead_with_the_injected_clock():
    clock = Clock()
    h = _healthy(HealthPolicy(suspect_after_s=10, dead_after_s=30), clock)
    assert h.check() is State.HEALTHY  # idle: silence is not a symptom
    clock.now = 100.0
    assert h.check() is State.HEALTHY
    h.call_started()
    clock.now = 109.0
    assert h.check() is State.HEALTHY
    clock.now = 110.0
    assert h.check() is State.SUSPECT
    clock.now = 129.5
    assert h.check() is State.SUSPECT
    clock.now = 130.0
    assert h.check() is State.DEAD
    assert h.history[-1].at == 130.0 and "no reply for 30 s" in h.history[-1].why


def test_a_reply_before_the_deadline_makes_a_suspect_healthy():
    clock = Clock()
    h = _healthy(HealthPolicy(suspect_after_s=1, dead_after_s=5), clock)
    h.call_started()
    clock.now = 2.0
    assert h.check() is State.SUSPECT
    h.succeeded()
    clock.now = 50.0
    assert h.check() is State.HEALTHY


def test_drain_stops_new_work_then_it_is_dead_and_restartable():
    h = _healthy()
    h.drain()
    assert h.state is State.DRAINING and not h.serving and not h.alive
    h.succeeded()  # a call that was in flight may still finish
    assert h.state is State.DRAINING
    h.drained()
    assert h.state is State.DEAD and h.begin_restart()


def test_missing_a_weight_version_makes_it_stale_until_synced():
    h = _healthy()
    h.missed(5, "load_weights timed out")
    assert h.state is State.STALE and not h.serving
    assert h.synced(5, 5) and h.serving


def test_retired_is_final_and_illegal_transitions_raise():
    h = _healthy()
    h.retire("scaled down")
    assert ALLOWED[State.RETIRED] == set()
    h.lost("after retirement")  # no effect
    assert h.state is State.RETIRED
    with pytest.raises(IllegalTransition):
        h.started()


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        HealthPolicy(suspect_after_s=10, dead_after_s=5)
    with pytest.raises(ValueError):
        HealthPolicy(max_restarts=-1)
