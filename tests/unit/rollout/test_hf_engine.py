import pytest
import torch

from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams, filter_logits
from rlpost.train.batch import collate, compute_logprobs


def _prompts(tok):
    return [
        tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "13-4=", "7*7=", "40+40="]
    ]


def test_completions_carry_ids_logprobs_reason_version(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok, batch_size=64, seed=0, version=3)
    out = engine.generate(_prompts(tok), SamplingParams(max_tokens=5), n=3, group_offset=10)
    assert len(out) == 12
    assert [c.group for c in out] == [10] * 3 + [11] * 3 + [12] * 3 + [13] * 3
    for c in out:
        assert c.policy_version == 3
        assert len(c.token_ids) == len(c.logprobs) <= 5
        assert all(lp <= 0 for lp in c.logprobs)
        stopped = c.token_ids and c.token_ids[-1] == tok.eos_token_id
        assert c.finish_reason == ("stop" if stopped else "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == 5 and c.truncated


def test_engine_logprobs_match_trainer_recompute(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok, batch_size=8, seed=1)  # small batch: several chunks
    out = engine.generate(_prompts(tok), SamplingParams(temperature=0.7, max_tokens=6), n=4)
    batch = collate(out, [0.0] * len(out), tok.pad_token_id)
    lp = compute_logprobs(model, batch, temperature=0.7, micro_batch_size=5)
    gap = ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max()
    assert gap < 1e-4


def test_shared_prefix_equals_repeated_prefill(tiny):
    """Prefill once + repeated KV must sample exactly what G separate prefills sample."""
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_tokens=6)
    a = HFEngine(model, tok, share_prefix=True, seed=5).generate(_prompts(tok), params, n=4)
    b = HFEngine(model, tok, share_prefix=False, seed=5).generate(_prompts(tok), params, n=4)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_greedy_is_deterministic_and_matches_argmax(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok)
    p = _prompts(tok)[:1]
    a = engine.generate(p, SamplingParams(temperature=0, max_tokens=4))[0]
    b = engine.generate(p, SamplingParams(temperature=0, max_tokens=4))[0]
    assert a.token_ids == b.token_ids
    logits = model(input_ids=torch.tensor(p)).logits[0, -1]
    assert a.token_ids[0] == int(logits.argmax())


def test_load_weights_changes_outputs_and_version(tiny):
    model, tok = tiny
    import copy

    serving = copy.deepcopy(model)
    engine = HFEngine(serving, tok)
    target = copy.deepcopy(model)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.5)
    engine.load_weights(target.named_parameters(), version=7)
    assert engine.version == 7
    for (n1, p1), (_, p2) in zip(
        serving.named_parameters(), target.named_parameters(), strict=True
    ):
        assert torch.equal(p1, p2), n1
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights([("nope.weight", torch.zeros(1))], version=8)


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    k = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isinf(k[0, 2:]).all() and torch.isfinite(k[0, :2]).all()
    probs = torch.softmax(logits, -1)[0]  # ~[0.64, 0.24, 0.09, 0.03]
    p = filter_logits(logits, top_k=-1, top_p=0.7)
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    assert probs[0] < 0.7
    assert torch.isfinite(filter_logits(logits, -1, 0.01)[0, 0])  # always keeps the top token


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=0), dict(max_tokens=0)]
)
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_stopped_row_gets_no_tokens_after_its_stop(tiny):
    """Rows that finish early stay in the batch until compaction; they must not grow."""
    model, tok = tiny
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():  # make EOS likely but not certain, so rows stop at different steps
        bias = torch.zeros(len(tok))
        bias[tok.eos_token_id] = 3.0
    m.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    out = HFEngine(m, tok, seed=0).generate(_prompts(tok) * 2, SamplingParams(max_tokens=40), n=4)
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped and any(len(c.token_ids) < 40 for c in stopped)
    for c in out:
        if tok.eos_token_id in c.token_ids:
            assert c.token_ids.index(tok.eos_token_id) == len(c.token_ids) - 1
            assert c.finish_reason == "stop"
        assert len(c.logprobs) == len(c.token_ids)


@pytest.mark.parametrize("engine_kind", ["hf", "continuous"])
def test_a_stop_text_ends_a_sample_on_the_token_that_completes_it(tiny, engine_kind):
    from rlpost.rollout.engines.continuous import ContinuousEngine
    from rlpost.rollout.engines.scheduler import Scheduler

    model, tok = tiny
    prompt = [_prompts(tok)[0]]

    def run(params):
        if engine_kind == "hf":
            return HFEngine(model, tok, batch_size=8, seed=5).generate(prompt, params, n=1)[0]
        scheduler = Scheduler(model, tok, max_batch=8, seed=5).start()
        try:
            return ContinuousEngine(scheduler, tok).generate(prompt, params, n=1)[0]
        finally:
            scheduler.stop()

    free = run(SamplingParams(max_tokens=24, seed=7))
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    assert len(text) >= 6, text
    stop = text[3:5]  # two characters the sample wrote: it must end where they first appear
    cut = text.index(stop) + len(stop)
    stopped = run(SamplingParams(max_tokens=24, seed=7, stop_texts=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]  # the same draws
    assert tok.decode(stopped.token_ids, skip_special_tokens=True) == text[:cut]
    assert stopped.logprobs == free.logprobs[: len(stopped.token_ids)]
