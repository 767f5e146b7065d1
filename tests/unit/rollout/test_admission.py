"""Fair admission across submissions: a huge request does not starve small ones (CPU)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

from rlpost.rollout.engines.admission import FairQueue
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.scheduler import GenerationRequest, Scheduler


def _tickets(count: int, n: int, name: str) -> list:
    return [
        SimpleNamespace(
            request=SimpleNamespace(n=n), cancelled=False, name=f"{name}{i}", admitted=0,
            future=Future(),
        )
        for i in range(count)
    ]  # fmt: skip


def _names(taken: list) -> list[str]:
    return [f"{t.name}:{s.start}-{s.stop}" for t, s in taken]


def test_a_free_slot_goes_to_the_submission_with_the_smallest_share():
    queue = FairQueue()
    huge = queue.push(_tickets(100, 4, "h"))
    small = queue.push(_tickets(2, 1, "s"))
    # The huge submission holds the batch (60 rows): the small one is served first.
    taken = queue.take(6, Counter({huge: 60}), 64, drop=None)
    assert _names(taken) == ["s0:0-1", "s1:0-1", "h0:0-4"]
    assert queue.sequences() == 99 * 4
    # Equal shares: the earlier submission first, then turns alternate.
    other = queue.push(_tickets(3, 4, "o"))
    taken = queue.take(16, Counter(), 64, drop=None)
    assert _names(taken) == ["h1:0-4", "o0:0-4", "h2:0-4", "o1:0-4"] and other == small + 1


def test_a_ticket_larger_than_the_room_joins_in_parts_and_holds_no_one_back():
    queue = FairQueue()
    big = queue.push(_tickets(1, 10, "b"))
    queue.push(_tickets(1, 1, "s"))
    # 3 free slots: the big ticket (first, no share yet) takes them all, not waiting for 10.
    assert _names(queue.take(3, Counter(), 64, drop=None)) == ["b0:0-3"]
    # Its 3 rows run: the small request, with no share, goes first at the next boundary.
    assert _names(queue.take(3, Counter({big: 3}), 64, drop=None)) == ["s0:0-1", "b0:3-5"]
    assert _names(queue.take(8, Counter({big: 5}), 64, drop=None)) == ["b0:5-10"]
    assert not queue


def test_a_submission_stays_within_its_cap_while_another_runs_or_waits():
    queue = FairQueue()
    big = queue.push(_tickets(1, 40, "b"))
    small = queue.push(_tickets(6, 1, "s"))
    # 12 free slots, but each submission takes 4 (the cap) while the other is there.
    taken = queue.take(12, Counter(), 4, drop=None)
    assert _names(taken) == ["b0:0-4", "s0:0-1", "s1:0-1", "s2:0-1", "s3:0-1"]
    assert queue.take(12, Counter({big: 4, small: 4}), 4, drop=None) == []
    # The small one's rows ended: its last two join; the big one, still beside them, waits.
    taken = queue.take(12, Counter({big: 4}), 4, drop=None)
    assert _names(taken) == ["s4:0-1", "s5:0-1"]
    assert queue.take(10, Counter({big: 4, small: 2}), 4, drop=None) == []
    # Alone, the big one fills the batch.
    assert _names(queue.take(10, Counter({big: 4}), 4, drop=None)) == ["b0:4-14"]


def test_cancelled_and_failed_tickets_are_dropped_once():
    queue = FairQueue()
    first = _tickets(3, 8, "a")
    first[0].cancelled = True
    first[1].future.set_exception(RuntimeError("its step failed"))
    queue.push(first)
    dropped = []
    taken = queue.take(4, Counter(), 64, drop=dropped.append)
    assert [t.name for t in dropped] == ["a0"] and _names(taken) == ["a2:0-4"]
    first[2].cancelled = True  # half admitted: the rest is dropped when met
    assert queue.take(4, Counter(), 64, drop=dropped.append) == []
    assert [t.name for t in dropped] == ["a0", "a2"] and not queue


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


def test_a_request_larger_than_the_batch_runs_in_parts_beside_a_small_one(tiny):
    """One ticket of 12 samples on a batch of 4: it never holds more than 4 rows, and a
    small request sent after it finishes while it still runs."""
    model, tok = tiny
    sched = Scheduler(model, tok, max_batch=4, max_request_batch=2, seed=0).start()
    try:
        prompt = tok("1+1=", add_special_tokens=False)["input_ids"]
        long = SamplingParams(temperature=1.0, max_tokens=20)
        big = sched.submit(GenerationRequest(prompt, long, n=12, ignore_eos=True))
        big_done_first: list[bool] = []
        short = SamplingParams(temperature=1.0, max_tokens=2)
        small = sched.submit_all(
            [GenerationRequest(prompt, short, n=1, ignore_eos=True)],
            on_done=lambda i, f: big_done_first.append(big.future.done()),
        )
        assert len(small[0].future.result(timeout=120)[0].token_ids) == 2
        outs = big.future.result(timeout=120)
        assert big_done_first == [False]
        assert len(outs) == 12 and all(len(o.token_ids) == 20 for o in outs)
        assert sched.counters["max_batch_seen"] <= 4
    finally:
        sched.stop()
