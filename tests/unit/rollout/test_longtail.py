"""Length prediction, length buckets and partial rollout."""

import pytest
import torch

from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.longtail import LengthPredictor, PartialRollout, bucket_by_length
from rlpost.train.batch import collate, compute_logprobs
from rlpost.types import Completion, Prompt

EOS = 2


class ScriptedEngine:
    """Every prompt is ``[target_length, 0]``; a sample ends with EOS at exactly that length."""

    def __init__(self):
        self.version = 0
        self.calls = []
        self.ns = []

    def generate(self, prompt_ids, params, n=1, group_offset=0):
        self.calls.append((len(prompt_ids), params.max_tokens))
        self.ns.append(n)
        out = []
        for i, ids in enumerate(prompt_ids):
            target, done = ids[0], len(ids) - 2
            for _ in range(n):
                k = min(params.max_tokens, target - done)
                tokens = [7] * k
                finished = done + k == target
                if finished:
                    tokens[-1] = EOS
                reason = "stop" if finished else "length"
                out.append(
                    Completion(
                        list(ids), tokens, [-0.5] * k, reason, self.version, group_offset + i
                    )
                )
        return out


def test_length_predictor_falls_back_from_uid_to_task_to_overall():
    pred = LengthPredictor(alpha=0.5, default=7.0)
    a = Prompt("a", uid="a", metadata={"task": "math"})
    assert pred.predict(a) == 7.0
    pred.observe(a, [10, 20])
    pred.observe(a, [30])
    assert pred.predict(a) == pytest.approx(0.5 * 15 + 0.5 * 30)
    assert pred.predict(Prompt("b", uid="b", metadata={"task": "math"})) == pytest.approx(22.5)
    assert pred.predict(Prompt("c", uid="c", metadata={"task": "code"})) == pytest.approx(22.5)
    state = pred.state_dict()
    other = LengthPredictor()
    other.load_state_dict(state)
    assert other.predict(a) == pred.predict(a)
    with pytest.raises(ValueError, match="alpha"):
        LengthPredictor(alpha=0)


def test_bucket_by_length_groups_similar_predictions():
    pred = LengthPredictor(alpha=1.0)
    prompts = [Prompt(str(i), uid=str(i)) for i in range(7)]
    for p, length in zip(prompts, [50, 3, 40, 4, 60, 5, 45], strict=True):
        pred.observe(p, [length])
    buckets = bucket_by_length(prompts, pred, 3)
    assert buckets == [[1, 3, 5], [2, 6], [0, 4]]
    assert sorted(i for b in buckets for i in b) == list(range(7))
    assert bucket_by_length(prompts[:2], pred, 5) == [[1], [0]]
    with pytest.raises(ValueError, match="n_buckets"):
        bucket_by_length(prompts, pred, 0)


def test_partial_rollout_carries_the_tail_and_loses_nothing():
    engine = ScriptedEngine()
    roll = PartialRollout(engine, fraction=0.8, chunk_tokens=8)
    params = SamplingParams(max_tokens=64)
    short, long = [4, 0], [40, 0]
    step1 = roll.step([short] * 8 + [long] * 2, params, n=2, payloads=list(range(10)))
    assert step1.payloads == list(range(8)) and step1.chunks == 1
    assert step1.carried_groups == 2 and step1.carried_samples == 4
    assert [c.group for c in step1.completions] == [g for g in range(8) for _ in range(2)]
    engine.version = 1
    step2 = roll.step([short] * 8, params, n=2, payloads=list(range(10, 18)))
    assert step2.payloads == list(range(10, 18)) and step2.carried_groups == 2
    engine.version = 2
    rest = roll.flush(params)
    assert rest.payloads == [8, 9] and rest.carried_groups == 0 and roll.pending == []
    for c in rest.completions:
        assert len(c.token_ids) == 40 and c.token_ids[-1] == EOS and c.finish_reason == "stop"
        assert c.policy_version == 0 and c.versions == [0, 1, 2]
        assert len(c.logprobs) == 40
    assert len(step1.completions) + len(step2.completions) + len(rest.completions) == 18 * 2


def test_fraction_one_waits_for_every_sample_and_length_caps():
    engine = ScriptedEngine()
    roll = PartialRollout(engine, fraction=1.0, chunk_tokens=8)
    step = roll.step([[4, 0], [100, 0]], SamplingParams(max_tokens=20), n=3)
    assert step.carried_groups == 0 and len(step.completions) == 6
    long = step.completions[3:]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in long)
    assert engine.calls[-1] == (3, 4)  # the last chunk asks only for what is left of max_tokens


def test_fresh_groups_are_asked_for_n_samples_in_one_call():
    engine = ScriptedEngine()
    roll = PartialRollout(engine, fraction=1.0, chunk_tokens=8)
    step = roll.step([[4, 0], [20, 0], [6, 0]], SamplingParams(max_tokens=64), n=4)
    # First chunk: all three prompts, 4 samples each (one prefill per prompt on a real engine);
    # then only the unfinished group's 4 samples, one row each.
    assert engine.calls[0] == (3, 8) and engine.ns[0] == 4
    assert all(n == 1 for n in engine.ns[1:]) and all(c[0] == 4 for c in engine.calls[1:])
    assert [len(c.token_ids) for c in step.completions] == [4] * 4 + [20] * 4 + [6] * 4


def test_carried_groups_survive_a_state_dict_round_trip():
    params = SamplingParams(max_tokens=64)
    prompts = [[4, 0]] * 4 + [[40, 0]]
    a = PartialRollout(ScriptedEngine(), fraction=0.8, chunk_tokens=8)
    first = a.step(prompts, params, n=2, payloads=[Prompt(str(i), uid=str(i)) for i in range(5)])
    assert first.carried_groups == 1
    b = PartialRollout(ScriptedEngine(), fraction=0.8, chunk_tokens=8)
    b.load_state_dict(a.state_dict())
    assert b.carried_samples == a.carried_samples == 2
    ra, rb = a.flush(params), b.flush(params)
    assert [p.uid for p in rb.payloads] == [p.uid for p in ra.payloads] == ["4"]
    assert [c.token_ids for c in rb.completions] == [c.token_ids for c in ra.completions]
    assert all(len(c.token_ids) == 40 for c in rb.completions)


def test_a_step_can_override_the_fraction_to_leave_nothing_behind():
    roll = PartialRollout(ScriptedEngine(), fraction=0.5, chunk_tokens=8)
    params = SamplingParams(max_tokens=64)
    assert roll.step([[4, 0]] * 3 + [[30, 0]], params, n=2).carried_groups == 1
    last = roll.step([[4, 0]], params, n=2, fraction=1.0)
    assert last.carried_groups == 0 and roll.pending == [] and len(last.payloads) == 2


def test_continuation_by_re_prefill_is_exact_on_the_hf_engine(tiny):
    model, tok = tiny
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "13-4="]]
    greedy = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(tok.eos_token_id,))
    whole = HFEngine(model, tok).generate(prompts, greedy, n=1)
    chunked = PartialRollout(HFEngine(model, tok), fraction=1.0, chunk_tokens=5).step(
        prompts, greedy, n=1
    )
    assert [c.token_ids for c in chunked.completions] == [c.token_ids for c in whole]
    sampled = SamplingParams(temperature=0.8, max_tokens=12, stop_token_ids=(tok.eos_token_id,))
    out = PartialRollout(HFEngine(model, tok, seed=3), fraction=1.0, chunk_tokens=4).step(
        prompts, sampled, n=3
    )
    batch = collate(out.completions, [0.0] * len(out.completions), tok.pad_token_id)
    lp = compute_logprobs(model, batch, temperature=0.8, micro_batch_size=6)
    assert float(((lp - batch.rollout_logprobs).abs() * batch.response_mask).max()) < 1e-4


def test_partial_rollout_rejects_bad_settings():
    with pytest.raises(ValueError, match="fraction"):
        PartialRollout(ScriptedEngine(), fraction=0)
    with pytest.raises(ValueError, match="payloads"):
        PartialRollout(ScriptedEngine()).step([[3, 0]], SamplingParams(), n=1, payloads=[1, 2])


class EosBoost(torch.nn.Module):
    """Makes EOS likely (~8% a token) so response lengths spread out."""

    def __init__(self, model, eos_id):
        super().__init__()
        self.model, self.eos_id, self.config = model, eos_id, model.config

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        out.logits[..., self.eos_id] += 2.2
        return out


def test_partial_rollout_on_the_continuous_engine_aborts_and_resumes(tiny):
    import copy

    from rlpost.rollout.engines.continuous import ContinuousEngine
    from rlpost.rollout.engines.scheduler import Scheduler

    model, tok = tiny
    model = EosBoost(copy.deepcopy(model), tok.eos_token_id)
    scheduler = Scheduler(model, tok, seed=0).start()
    try:
        engine = ContinuousEngine(scheduler)
        roll = PartialRollout(engine, fraction=0.5)
        prompts = [
            tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "3+4=", "5+6=", "7+8="]
        ]
        params = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(tok.eos_token_id,))
        first = roll.step(prompts, params, n=2, payloads=[0, 1, 2, 3])
        assert first.done_fraction >= 0.5 and len(first.completions) == 2 * len(first.payloads)
        carried = [s for g in roll.pending for s in g.samples if s.finish is None]
        assert carried and any(s.tokens for s in carried)  # aborted with their tokens kept
        batch = collate(first.completions, [0.0] * len(first.completions), tok.pad_token_id)
        lp = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8)
        assert float(((lp - batch.rollout_logprobs).abs() * batch.response_mask).max()) < 1e-4
        engine.load_weights(model.named_parameters(), version=1)
        rest = roll.flush(params)
        assert sorted(first.payloads + rest.payloads) == [0, 1, 2, 3] and roll.pending == []
        spanned = [c for c in rest.completions if c.versions == [0, 1]]
        assert all(c.policy_version == 0 for c in spanned)
        for c in first.completions + rest.completions:
            assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == "length" or c.token_ids[-1] == tok.eos_token_id
    finally:
        scheduler.stop()
