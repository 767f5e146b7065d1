"""run.threads=0 during a run: the decision function and the follower over given samples."""

import pytest

from rlpost.observe import mfu
from rlpost.observe.threads import ThreadFollower, follow_threads, start_threads


@pytest.mark.parametrize(
    ("current", "cores", "others", "expected"),
    [
        (1, 2, 0.0, 2),  # the start's other load went away: take the core back
        (2, 2, 1.0, 1),  # another job holds a core: leave it to it
        (2, 2, 0.6, 2),  # near the boundary: keep, so the count does not flip each step
        (1, 2, 0.3, 1),  # the same band on the way up
        (1, 2, 0.2, 2),
        (2, 2, 7.0, 1),  # overloaded: never below one
        (8, 8, 3.0, 5),
        (5, 8, -1.0, 8),  # a negative estimate counts as no other load
        (4, 2, 0.0, 2),  # never above the cores
    ],
)
def test_threads_follow_the_free_cores_with_a_band(current, cores, others, expected):
    assert follow_threads(current, cores, others) == expected


def test_impossible_counts_are_refused():
    with pytest.raises(ValueError, match="threads and cores must be >= 1"):
        follow_threads(0, 2, 0.0)


def _jiffies(busy: int, idle: int) -> list[int]:
    return [busy, 0, 0, idle, 0, 0, 0, 0]  # user nice system idle iowait irq softirq steal


def test_the_follower_subtracts_its_own_cpu_and_says_each_change():
    # 2 cores, 100 jiffies a second each; samples of (wall s, own CPU s, jiffies so far)
    samples = iter(
        [
            (0.0, 0.0, _jiffies(0, 0)),
            (10.0, 20.0, _jiffies(2000, 0)),  # both cores busy, all of it this process's
            (20.0, 30.0, _jiffies(4000, 0)),  # both busy, this process one: another job
            (30.0, 40.0, _jiffies(5000, 1000)),  # only this process's core busy
            (40.0, 50.0, None),  # /proc/stat unreadable: unchanged
        ]
    )
    said, set_to = [], []
    f = ThreadFollower(set_to.append, 2, said.append, cores=2, sample=lambda: next(samples))
    assert f.after_step() == 2 and not said and not set_to  # its own threads do not count
    assert f.after_step() == 1 and set_to == [1]
    assert said[-1].startswith("rlpost: run.threads=0: 2 -> 1 threads (1.0 of 2 cores busy")
    assert f.after_step() == 2 and set_to == [1, 2] and len(said) == 2
    assert f.after_step() == 2 and f.changes == 2


def test_start_says_what_run_threads_0_chose_and_why(monkeypatch):
    monkeypatch.setattr(mfu, "_AUTO_THREADS", [])
    monkeypatch.setattr(mfu, "_AUTO_WHY", [])
    monkeypatch.setattr(mfu, "_load", lambda: 1.2)
    monkeypatch.setattr(mfu, "_usable_cores", lambda: 2)
    said, set_to = [], []
    follower = start_threads(0, set_to.append, said.append)
    assert set_to == [1] and follower is not None and follower.current == 1
    assert said == [
        "rlpost: run.threads=0 -> 1 thread (2 usable cores, 1.2 busy with other work); "
        "re-checked after every step"
    ]
    said.clear()
    assert start_threads(3, set_to.append, said.append) is None  # a fixed count stands
    assert set_to == [1, 3] and not said
