"""Fair admission across submissions: a huge request does not starve small ones (CPU)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from rlpost.rollout.admission import FairQueue
from rlpost.rollout.protocol import SamplingParams
from rlpost.rollout.scheduler import GenerationRequest, Scheduler


def _tickets(count: int, n: int, name: str) -> list:
    return [
        SimpleNamespace(request=SimpleNamespace(n=n), cancelled=False, name=f"{name}{i}")
        for i in range(count)
    ]


def test_a_free_slot_goes_to_the_submission_with_the_smallest_share():
    queue = FairQueue()
    huge = queue.push(_tickets(100, 4, "h"))
    small = queue.push(_tickets(2, 1, "s"))
    # The huge submission holds the batch (60 rows): the small one is served first.
    taken = queue.take(6, Counter({huge: 60}), True, drop=None)
    assert [t.name for t in taken] == ["s0", "s1", "h0"]
    assert queue.sequences() == 99 * 4
    # Equal shares: the earlier submission first, then turns alternate.
    other = queue.push(_tickets(3, 4, "o"))
    taken = queue.take(16, Counter(), False, drop=None)
    assert [t.name for t in taken] == ["h1", "o0", "h2", "o1"] and other == small + 1


def test_cancelled_tickets_are_dropped_and_a_ticket_too_big_waits_for_room():
    queue = FairQueue()
    first = _tickets(2, 8, "a")
    first[0].cancelled = True
    queue.push(first)
    queue.push(_tickets(1, 1, "b"))
    dropped = []
    taken = queue.take(4, Counter(), True, drop=dropped.append)
    # a1 (n=8) does not fit in 4 with rows running; b0 may not jump over it... unless its
    # share is smaller, which it is not here (both 0, a came first).
    assert [t.name for t in dropped] == ["a0"] and taken == []
    taken = queue.take(4, Counter(), False, drop=dropped.append)  # alone: it takes the batch
    assert [t.name for t in taken] == ["a1"]
    assert [t.name for t in queue.take(4, Counter(), False, dropped.append)] == ["b0"]
    assert not queue


def test_a_small_request_finishes_while_a_huge_one_ahead_of_it_still_runs(tiny):
    model, tok = tiny
    sched = Scheduler(model, tok, max_batch=4, seed=0).start()
    try:
        params = SamplingParams(temperature=1.0, max_tokens=8)
        order: list[str] = []
        prompt = tok("1+1=", add_special_tokens=False)["input_ids"]
        big = [GenerationRequest(prompt, params, n=2, ignore_eos=True) for _ in range(24)]
        huge = sched.submit_all(big, on_done=lambda i, f: order.append("huge"))
        small = sched.submit_all(
            [GenerationRequest(prompt, params, n=1, ignore_eos=True)],
            on_done=lambda i, f: order.append("small"),
        )
        small[0].future.result(timeout=120)
        for t in huge:
            t.future.result(timeout=120)
        # First come, first served would finish all 24 huge tickets first.
        assert order.index("small") < 8, order
    finally:
        sched.stop()
