"""Continuous batching scheduler on the tiny model (CPU)."""

import copy
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import replace

import pytest
import torch

from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.scheduler import GenerationRequest, Scheduler
from rlpost.train.batch import collate, compute_logprobs
from rlpost.types import Completion

TEXTS = ["1+2=", "13-4=", "7*7=", "40+40="]


@pytest.fixture
def model_tok(tiny):
    model, tok = tiny
    return copy.deepcopy(model), tok


@pytest.fixture
def sched(model_tok):
    model, tok = model_tok
    s = Scheduler(model, tok, max_batch=64, seed=0).start()
    yield s
    s.stop()


def _ids(tok, texts=TEXTS):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _run(sched, prompt, params, **kw):
    return sched.submit(GenerationRequest(prompt, params, **kw)).future.result(timeout=60)


def test_greedy_matches_in_process_engine(sched, model_tok):
    model, tok = model_tok
    params = SamplingParams(temperature=0, max_tokens=12)
    tickets = [sched.submit(GenerationRequest(p, params, n=2)) for p in _ids(tok)]
    got = [t.future.result(timeout=60) for t in tickets]
    ref = HFEngine(model, tok).generate(_ids(tok), params, n=2)
    assert [o.token_ids for outs in got for o in outs] == [c.token_ids for c in ref]
    for outs, i in zip(got, range(0, len(ref), 2), strict=True):
        assert outs[0].logprobs == pytest.approx(ref[i].logprobs, abs=1e-4)
        assert outs[0].finish_reason == ref[i].finish_reason


def test_joining_requests_keep_trainer_logprobs(sched, model_tok):
    """Requests joining mid-flight (left-padded KV) still match the trainer's recompute."""
    model, tok = model_tok
    params = SamplingParams(temperature=0.7, max_tokens=10)
    prompts = _ids(tok) + _ids(tok, ["2+2=", "99-1="])
    first = sched.stats()["tokens"]
    tickets = [sched.submit(GenerationRequest(prompts[0], replace(params, max_tokens=100), n=3))]
    deadline = time.time() + 30
    while sched.stats()["tokens"] == first and time.time() < deadline:
        time.sleep(0.001)  # the first request is decoding: the others join it mid-flight
    tickets += sched.submit_all(
        [GenerationRequest(p, params, n=3, seed=i) for i, p in enumerate(prompts[1:], 1)]
    )
    outs = [t.future.result(timeout=60) for t in tickets]
    comps = [
        Completion(prompts[i], o.token_ids, o.logprobs, o.finish_reason, o.policy_version, i)
        for i, group in enumerate(outs)
        for o in group
    ]
    batch = collate(comps, [0.0] * len(comps), tok.pad_token_id)
    lp = compute_logprobs(model, batch, temperature=0.7, micro_batch_size=8)
    assert float(((lp - batch.rollout_logprobs).abs() * batch.response_mask).max()) < 1e-4
    assert sched.stats()["max_batch_seen"] > 3  # more than one request per decode step


def test_finished_sequences_leave_and_waiting_ones_join(model_tok):
    model, tok = model_tok
    s = Scheduler(model, tok, max_batch=4).start()
    try:
        long = SamplingParams(temperature=0, max_tokens=40)
        short = SamplingParams(temperature=0, max_tokens=3)
        p = _ids(tok)
        order = []
        tickets = {}
        for name, prompt, params in [("a", p[0], long), ("b", p[1], short), ("c", p[2], short)]:
            tickets[name] = s.submit(GenerationRequest(prompt, params, n=2))
            tickets[name].future.add_done_callback(lambda _, name=name: order.append(name))
        results = {k: t.future.result(timeout=60) for k, t in tickets.items()}
        assert len(results["a"][0].token_ids) > 6, "a must outlive b and c for this test"
        # c could not fit while a and b held the 4 slots; it joined when b left, and
        # finished while a was still decoding.
        assert order == ["b", "c", "a"]
        stats = s.stats()
        assert stats["max_batch_seen"] == 4
        assert stats["steps"] < len(results["a"][0].token_ids) + 6
    finally:
        s.stop()


def test_group_prefilled_once_and_repeats_hit_the_cache(sched, model_tok):
    _, tok = model_tok
    params = SamplingParams(temperature=1.0, max_tokens=4)
    prompt = _ids(tok)[0]
    _run(sched, prompt, params, n=8)
    assert sched.stats()["prefills"] == 1
    _run(sched, prompt, params, n=4)
    assert sched.stats()["prefills"] == 1
    assert sched.prefix_cache.hits >= 1


def test_partial_prefix_reuses_cached_kv(model_tok):
    model, tok = model_tok
    params = SamplingParams(temperature=0, max_tokens=6)
    base, longer = _ids(tok, ["12+34=", "12+34=46 and 5+5="])
    warm = Scheduler(model, tok).start()
    cold = Scheduler(model, tok).start()
    try:
        _run(warm, base, params)
        got = _run(warm, longer, params)
        assert warm.prefix_cache.reused_tokens == len(base)
        ref = _run(cold, longer, params)
        assert got[0].token_ids == ref[0].token_ids
        assert got[0].logprobs == pytest.approx(ref[0].logprobs, abs=1e-4)
    finally:
        warm.stop()
        cold.stop()


def test_weight_update_changes_outputs_version_and_clears_cache(sched, model_tok):
    model, tok = model_tok
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = _ids(tok)[0]
    before = _run(sched, prompt, params)[0]
    target = {k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
    sched.load_weights(target.items(), version=4)
    after = _run(sched, prompt, params)[0]
    assert sched.version == 4 and after.policy_version == 4 and before.policy_version == 0
    assert after.token_ids != before.token_ids
    assert sched.stats()["prefills"] == 2  # the old prompt KV was not reused


def test_bad_weights_change_nothing(sched, model_tok):
    model, _ = model_tok
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(iter(snapshot))
    with pytest.raises(KeyError, match="not a parameter"):
        sched.load_weights([(name, snapshot[name] + 1), ("nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="shape"):
        sched.load_weights([(name, torch.zeros(3, 3, 3))], version=1)
    assert sched.version == 0
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def test_a_stream_with_announced_shapes_is_checked_first_and_applied_lazily(sched, model_tok):
    model, _ = model_tok
    target = {k: v + 0.1 for k, v in model.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in target.items()}
    consumed_on: list[str] = []

    def stream():
        for item in target.items():
            consumed_on.append(threading.current_thread().name)
            yield item

    bad = {**shapes, next(iter(shapes)): (3, 3, 3)}
    with pytest.raises(ValueError, match="shape"):
        sched.load_weights(stream(), version=1, shapes=bad)
    assert not consumed_on and sched.version == 0  # refused before one tensor was read
    sched.load_weights(stream(), version=2, shapes=shapes)
    assert sched.version == 2 and len(consumed_on) == len(target)
    assert threading.current_thread().name not in consumed_on  # read on the scheduler thread
    assert all(torch.equal(v, target[k]) for k, v in model.state_dict().items())


def test_update_mid_request_is_applied_between_steps(sched, model_tok):
    model, tok = model_tok
    params = SamplingParams(temperature=1.0, max_tokens=100, stop_token_ids=())
    ticket = sched.submit(GenerationRequest(_ids(tok)[0], params, n=4, seed=1))
    while sched.stats()["steps"] < 5:
        time.sleep(0.005)
    sched.load_weights(model.state_dict().items(), version=1)
    outs = ticket.future.result(timeout=60)
    spanning = [o for o in outs if o.versions == [0, 1]]
    assert spanning, "the in-flight samples continue under the new version"
    for o in spanning:
        assert o.policy_version == 0  # the version of the first token
        switch = o.token_versions.index(1)
        assert set(o.token_versions[:switch]) == {0} and set(o.token_versions[switch:]) == {1}


def test_cancel_frees_the_slots(sched, model_tok):
    _, tok = model_tok
    params = SamplingParams(temperature=1.0, max_tokens=110, stop_token_ids=())
    ticket = sched.submit(GenerationRequest(_ids(tok)[0], params, n=16))
    while sched.stats()["active"] == 0:
        time.sleep(0.005)
    sched.cancel(ticket)
    with pytest.raises(CancelledError):
        ticket.future.result(timeout=30)
    deadline = time.time() + 10
    while sched.stats()["active"] and time.time() < deadline:
        time.sleep(0.01)
    assert sched.stats()["active"] == 0 and sched.stats()["cancelled"] == 1


def test_stop_text_seed_and_top_logprobs(sched, model_tok):
    _, tok = model_tok
    prompt = _ids(tok)[1]
    greedy = _run(sched, prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    text = tok.decode(greedy.token_ids, skip_special_tokens=True)
    stop = text[3:5]
    cut = _run(sched, prompt, SamplingParams(temperature=0, max_tokens=12), stop_texts=(stop,))[0]
    assert cut.finish_reason == "stop" and cut.text_end == text.find(stop)
    assert len(cut.token_ids) < len(greedy.token_ids) or greedy.finish_reason == "stop"
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    a = _run(sched, prompt, sampled, seed=7, top_logprobs=3)[0]
    b = _run(sched, prompt, sampled, seed=7)[0]
    assert a.token_ids == b.token_ids
    assert len(a.top_logprobs) == len(a.token_ids)
    for alts, lp in zip(a.top_logprobs, a.logprobs, strict=True):
        values = [v for _, v in alts]
        assert len(alts) == 3 and values == sorted(values, reverse=True) and lp <= values[0] + 1e-6


def test_a_failing_step_fails_its_requests_not_the_scheduler(sched, model_tok):
    model, tok = model_tok
    real = model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    model.forward = flaky
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        with pytest.raises(RuntimeError, match="boom"):
            _run(sched, _ids(tok)[0], params)
        assert sched.alive and sched.stats()["errors"] == 1
        assert len(_run(sched, _ids(tok)[0], params)[0].token_ids) >= 1
    finally:
        del model.forward


def test_submit_rejects_empty_prompt(sched):
    with pytest.raises(ValueError, match="empty prompt"):
        sched.submit(GenerationRequest([], SamplingParams()))


def test_concurrent_submitters(sched, model_tok):
    _, tok = model_tok
    params = SamplingParams(temperature=1.0, max_tokens=6)
    results = {}

    def worker(i):
        results[i] = _run(sched, _ids(tok)[i % 4], params, n=2)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(8))
    assert all(len(r) == 2 for r in results.values())


def test_abort_keeps_partial_samples_that_continue_exactly(sched, model_tok):
    _, tok = model_tok
    prompt = _ids(tok)[2]
    greedy = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=())
    whole = _run(sched, prompt, SamplingParams(temperature=0, max_tokens=60))[0]
    steps = sched.stats()["steps"]
    ticket = sched.submit(GenerationRequest(prompt, greedy, n=2, ignore_eos=True))
    while sched.stats()["steps"] < steps + 3:
        time.sleep(0.002)
    sched.cancel(ticket, keep_partial=True)
    parts = ticket.future.result(timeout=30)
    assert all(p.finish_reason == "abort" and 0 < len(p.token_ids) < 60 for p in parts)
    assert all(len(p.logprobs) == len(p.token_versions) == len(p.token_ids) for p in parts)
    head = parts[0].token_ids
    if whole.finish_reason == "length" or len(whole.token_ids) > len(head):
        assert head == whole.token_ids[: len(head)]
    rest = _run(sched, prompt + head, SamplingParams(temperature=0, max_tokens=60 - len(head)))[0]
    assert head + rest.token_ids == whole.token_ids
    never_admitted = Scheduler(sched.model, tok)  # not started: the request stays queued
    queued = never_admitted.submit(GenerationRequest(prompt, greedy, n=2))
    never_admitted.cancel(queued, keep_partial=True)
    never_admitted.start()
    assert [o.token_ids for o in queued.future.result(timeout=30)] == [[], []]
    assert queued.future.result()[0].policy_version is None
    never_admitted.stop()


def test_a_stream_that_fails_part_way_pauses_serving_until_a_whole_update(sched, model_tok):
    """Half the tensors written, then the stream breaks: the version stays, running requests
    fail, new ones wait (never sampled from a mix of two versions) until an update rewrites
    what was written; then they run on the new weights."""
    model, tok = model_tok
    target = {k: v + 0.1 for k, v in model.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in target.items()}
    half = len(target) // 2

    def broken():
        for i, item in enumerate(target.items()):
            if i == half:
                raise OSError("the spool file is gone")
            yield item

    with pytest.raises(OSError, match="spool"):
        sched.load_weights(broken(), version=1, shapes=shapes)
    assert sched.version == 0 and sched.stats()["weights_mixed"] == half
    params = SamplingParams(temperature=0, max_tokens=4)
    ticket = sched.submit(GenerationRequest(_ids(tok)[0], params))
    time.sleep(0.3)
    assert not ticket.future.done()  # waits: the model holds two versions
    sched.load_weights(target.items(), version=2)
    (out,) = ticket.future.result(timeout=60)
    assert out.policy_version == 2 and sched.stats()["weights_mixed"] == 0


def test_an_empty_update_is_refused(sched):
    with pytest.raises(ValueError, match="no tensor"):
        sched.load_weights([], version=3)
    with pytest.raises(ValueError, match="no tensor"):
        sched.load_weights(iter([]), version=3, shapes={})
    assert sched.version == 0


def test_a_timed_out_update_that_never_started_is_withdrawn(model_tok):
    model, tok = model_tok
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    s = Scheduler(model, tok)  # not started: nothing applies updates
    target = {k: v + 1.0 for k, v in model.state_dict().items()}
    with pytest.raises(TimeoutError):
        s.load_weights(target.items(), version=5, timeout=0.2)
    s.start()
    try:
        time.sleep(0.2)
        assert s.version == 0  # withdrawn: applied neither then nor later
        assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())
    finally:
        s.stop()


def test_a_stopped_scheduler_refuses_work_instead_of_leaving_it_waiting(model_tok):
    model, tok = model_tok
    s = Scheduler(model, tok).start()
    s.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        s.submit(GenerationRequest(_ids(tok)[0], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="stopped"):
        s.load_weights(model.state_dict().items(), version=1)
