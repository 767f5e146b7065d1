"""The Tinker service's worker: sessions take turns, a fault answers its own future."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("tinker")

from rlpost.tinker.service import Future, Worker
from rlpost.tinker.wire import BadInput


def _wait(futures: list[Future]) -> None:
    deadline = time.monotonic() + 10
    while not all(f.done for f in futures) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(f.done for f in futures)


def test_sessions_take_turns_round_robin():
    worker, order, started, gate = Worker(), [], threading.Event(), threading.Event()
    first = Future("a")
    worker.submit("a", first, lambda: (started.set(), gate.wait()))  # holds the worker
    started.wait(10)
    futures = [first]
    for lane, n in (("a", 4), ("b", 2), ("c", 1)):
        for i in range(n):
            futures.append(Future(lane))
            worker.submit(lane, futures[-1], lambda tag=f"{lane}{i}": order.append(tag))
    gate.set()
    _wait(futures)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_work_of_an_ended_session_is_dropped():
    ended = {"gone"}
    worker = Worker(live=lambda lane: lane not in ended)
    dropped, kept, ran = Future("a"), Future("a"), []
    worker.submit("gone", dropped, lambda: ran.append("gone"))
    worker.submit("here", kept, lambda: ran.append("here"))
    _wait([dropped, kept])
    assert ran == ["here"] and "session has ended" in dropped.error


def test_a_fault_answers_its_future_and_the_worker_goes_on():
    worker = Worker()
    bad, fault, good = Future("a"), Future("a"), Future("a")

    def raise_(exc):
        raise exc

    worker.submit("a", bad, lambda: raise_(BadInput("data[0].weights: wrong")))
    worker.submit("a", fault, lambda: raise_(RuntimeError("boom")))
    worker.submit("a", good, lambda: 7)
    _wait([bad, fault, good])
    assert (bad.error, bad.category) == ("data[0].weights: wrong", "user")
    assert fault.error == "RuntimeError: boom" and fault.category == "server"
    assert good.value == 7 and good.error is None


def test_work_under_one_key_runs_as_one_batch():
    """Samples of one sampler with the same params queue up while the worker is busy and run
    as one call, each future getting its own value; another key and other lanes wait their turn."""
    worker, calls, started, gate = Worker(), [], threading.Event(), threading.Event()
    first = Future("a")
    worker.submit("a", first, lambda: (started.set(), gate.wait()))
    started.wait(10)

    def batch(args):
        calls.append(list(args))
        return [x * 10 for x in args]

    futures = {}
    for lane, key, arg in (("a", "k", 1), ("a", "j", 2), ("b", "k", 3), ("a", "k", 4)):
        futures[arg] = Future(lane)
        worker.submit(lane, futures[arg], batch, key=(lane, key), arg=arg)
    gate.set()
    _wait([first, *futures.values()])
    assert calls == [[1, 4], [3], [2]]
    assert {arg: f.value for arg, f in futures.items()} == {1: 10, 2: 20, 3: 30, 4: 40}


def test_a_burst_of_work_under_one_key_runs_as_one_batch_on_an_idle_worker():
    """The SDK sends a group's samples one request each: work arriving a few ms apart on an
    idle worker still runs as one call."""
    worker, calls = Worker(), []

    def batch(args):
        calls.append(list(args))
        return args

    futures = []
    for i in range(6):
        futures.append(Future("a"))
        worker.submit("a", futures[-1], batch, key="k", arg=i)
        time.sleep(0.005)
    _wait(futures)
    assert calls == [[0, 1, 2, 3, 4, 5]]


def test_engine_vllm_refuses_what_vllm_cannot_serve_in_one_line(tmp_path, capsys):
    """vLLM serves HF directories: a GGUF base (or no vLLM) is refused before serving."""
    from rlpost.tinker.service import main

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as exc:
        main(["--model", f"m={gguf}", "--engine", "vllm", "--port", "0"])
    line = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in line and line.startswith("rlpost tinker: error:")
    assert "--engine vllm" in line and ("m.gguf" in line or "not installed" in line)


def test_a_vllm_base_needs_a_model_directory():
    from rlpost.api import APIError, Base

    with pytest.raises(APIError, match="engine=vllm: serves an HF model directory"):
        Base.load(None, engine="vllm")


def test_requests_of_one_prompt_share_a_prefill_and_each_gets_its_own_samples(tmp_path):
    """The cookbook asks for a group's samples one request each: the engine sees each distinct
    prompt once, with n covering its requests, and every request gets num_samples back."""
    import rlpost.api as api
    from rlpost.tinker.service import Ops, Sampler, Service, types
    from rlpost.tinker.wire import pb

    svc = Service({"tiny": None}, tmp_path, set(), "cpu")
    s = Sampler("s", "o", "tiny", None, engine=api.Sampler(svc.base("tiny"), None))
    calls, sample = [], s.engine.sample
    s.engine.sample = lambda prompts, params, n: (
        calls.append((len(prompts), n)) or sample(prompts, params, n)
    )
    params = types.SamplingParams(max_tokens=3, temperature=1.0)
    asks = [[5, 6, 7]] * 3 + [[9, 10]] * 3 + [[11]]
    reqs = [
        types.SampleRequest(
            sampling_session_id="s", prompt=types.ModelInput.from_ints(p), num_samples=2,
            sampling_params=params,
        )
        for p in asks
    ]  # fmt: skip
    out = [pb.SampleResponse.FromString(b) for b in Ops(svc).sample(s, reqs)]
    assert sorted(calls) == [(1, 2), (2, 6)]
    assert [len(o.sequences) for o in out] == [2] * 7
    assert all(4 <= len(q.tokens) <= 12 for o in out for q in o.sequences)  # int32 bytes
