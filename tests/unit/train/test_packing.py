"""Packed passes: the rows end to end with restarting positions give the padded numbers
(logprobs, entropy, gradients, values, whole updates), and a model that cannot pack pads
with one warning line."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpost.algos import get_advantage_estimator, get_policy_loss, scores_to_token_rewards
from rlpost.train import packing
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.batch import FULL_LOGITS, collate, response_logprobs, response_sum_pi_squared
from rlpost.train.critic import CriticTrainer, ValueModel
from rlpost.train.optim import budget_slices
from rlpost.train.packing import pack_reason, pack_rows, resolve_packing
from rlpost.types import Completion

VOCAB = 300


def _model(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of a useful spread (a fresh head gives near-uniform ones)
        model.lm_head.weight.mul_(10.0)
    return model


def _batch(n: int = 4):
    """Rows of mixed lengths: loss-masked tokens, a fully masked row, one long row."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(7, 3, None), (2, 6, [1, 0, 0, 1, 1, 0]), (5, 2, [0, 0]), (3, 14, None)]
    shapes += [(2 + i % 5, 1 + (3 * i) % 9, None) for i in range(n - len(shapes))]
    rows = []
    for i, (p_len, r_len, mask) in enumerate(shapes[:n]):
        prompt = torch.randint(1, VOCAB, (p_len,), generator=gen).tolist()
        response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
        rows.append(Completion(prompt, response, [-1.0] * r_len, "stop", 0, i // 4, loss_mask=mask))
    b = collate(rows, [float(i % 2) for i in range(n)], 0)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


@pytest.mark.parametrize("line_tokens", [0, 12])
def test_pack_rows_lays_real_tokens_end_to_end(line_tokens):
    b = _batch(6)
    rows = pack_rows(b, line_tokens)
    p_lens, r_lens = b.lengths()
    lengths = (p_lens + r_lens).tolist()
    k, width = rows.input_ids.shape
    if line_tokens == 0:  # one sequence, no tail
        assert (k, width) == (1, sum(lengths))
    else:  # sequences of 12 tokens, or one row longer than that alone
        assert k > 1 and width == max(lengths)
    ids, pos = rows.input_ids.flatten(), rows.position_ids.flatten()
    starts = pos.eq(0).nonzero().flatten().tolist()
    for i, n in enumerate(lengths):  # each row whole, at a restart, positions 0 .. n - 1
        real = b.input_ids[i][b.attention_mask[i].bool()]
        assert any(
            torch.equal(ids[s : s + n], real) and torch.equal(pos[s : s + n], torch.arange(n))
            for s in starts
        )
    # each target is the token right after the place that predicts it
    torch.testing.assert_close(rows.input_ids.flatten()[rows.at + 1], rows.targets)
    assert rows.where.sum() == r_lens.sum() == len(rows.at)


def _grads(model, fn, mask):
    model.zero_grad()
    lp, ent = fn()
    ((lp * mask).sum() * 0.7 - (ent * mask).sum() * 0.3).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("chunk", "line_tokens"), [(FULL_LOGITS, 0), (0, 0), (4, 0), (0, 12)])
def test_packed_logprobs_entropy_and_grads_equal_padded(attn, chunk, line_tokens, monkeypatch):
    """Also with the rows in several sequences (12 tokens each, a tail of padding)."""
    monkeypatch.setattr(packing, "LINE_TOKENS", line_tokens or packing.LINE_TOKENS)
    model, b, tau = _model(attn), _batch(), 0.8
    mask = b.response_mask
    real = b.attention_mask[:, b.prompt_width :].bool()

    def run(packed):
        return response_logprobs(model, b, tau, with_entropy=True, chunk=chunk, packed=packed)

    (lp, ent), (plp, pent) = run(False), run(True)
    torch.testing.assert_close(plp[real], lp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pent[real], ent[real], atol=1e-5, rtol=1e-5)
    assert (plp[~real] == 0).all()  # padding holds 0
    padded, packed = _grads(model, lambda: run(False), mask), _grads(model, lambda: run(True), mask)
    assert padded.keys() == packed.keys()
    for name, g in padded.items():
        torch.testing.assert_close(packed[name], g, atol=1e-5, rtol=1e-4, msg=name)
    pi2 = response_sum_pi_squared(model, b, tau, chunk=chunk)
    ppi2 = response_sum_pi_squared(model, b, tau, chunk=chunk, packed=True)
    torch.testing.assert_close(ppi2[real], pi2[real], atol=1e-6, rtol=1e-5)


def test_packed_budget_counts_real_tokens():
    prompt = torch.tensor([3, 9, 2, 2, 5, 4, 2, 8])
    response = torch.tensor([1, 20, 2, 3, 1, 2, 2, 1])
    slices = budget_slices(torch.arange(8), prompt, response, 4, 24, packed=True)
    assert sorted(torch.cat(slices).tolist()) == list(range(8))
    for s in slices:
        assert len(s) <= 4 and (len(s) == 1 or int((prompt + response)[s].sum()) <= 24)
    # packing fits more rows in the budget than padding does
    assert len(slices) < len(budget_slices(torch.arange(8), prompt, response, 4, 24))


def _trainer(model, packing: str, micro: int, budget: int = 0):
    s = ActorSettings(
        lr=1e-3,
        mini_batch_size=8,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=budget,
        entropy_coef=0.01,
        packing=packing,
    )
    return PolicyTrainer(model, get_policy_loss("ppo_clip"), s)


@pytest.mark.parametrize(("micro", "budget"), [(8, 0), (3, 0), (8, 40)])
def test_packed_update_equals_the_padded_update(micro, budget):
    """Two optimizer steps: the same old logprobs, losses and weights as one padded
    micro-batch per mini-batch, whether packed micro-batches hold 8 rows, 3 or a budget."""
    base, b = _model(), _batch(16)
    a, c = copy.deepcopy(base), copy.deepcopy(base)
    ta, tc = _trainer(a, "on", micro, budget), _trainer(c, "off", 8)
    assert ta.packed and not tc.packed
    b1, b2 = copy.deepcopy(b), copy.deepcopy(b)
    b1.old_logprobs, b2.old_logprobs = ta.old_logprobs(b1), tc.old_logprobs(b2)
    mask = b.response_mask.bool()
    torch.testing.assert_close(b1.old_logprobs[mask], b2.old_logprobs[mask], atol=1e-5, rtol=0)
    s1, s2 = ta.update(b1).stats, tc.update(b2).stats
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)
    assert s1["entropy"] == pytest.approx(s2["entropy"], abs=1e-5)
    moved = max((p - q).abs().max() for p, q in zip(a.parameters(), base.parameters(), strict=True))
    assert moved > 1e-4
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_packed_critic_values_and_update_equal_padded():
    base, b = _model(), _batch(16)
    b.returns = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(3))

    def critic(packing, micro, budget=0):
        torch.manual_seed(5)  # the same value head
        return CriticTrainer(
            ValueModel.from_policy(copy.deepcopy(base)),
            lr=1e-3,
            mini_batch_size=8,
            micro_batch_size=micro,
            max_tokens_per_micro_batch=budget,
            packing=packing,
        )

    padded, packed = critic("off", 8), critic("on", 3, 40)
    assert packed.packed
    b.values = padded.values(b)
    torch.testing.assert_close(packed.values(b), b.values, atol=1e-5, rtol=1e-5)
    s1, s2 = packed.update(copy.deepcopy(b)), padded.update(copy.deepcopy(b))
    assert s1["vf_loss"] == pytest.approx(s2["vf_loss"], abs=1e-6)
    for p, q in zip(packed.model.parameters(), padded.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


class _NoBoundaries(torch.nn.Module):
    """A causal LM stand-in whose attention ignores position ids (a recurrent mixer)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def get_decoder(self):
        inner = self.inner.get_decoder()

        def forward(input_ids, position_ids=None, **kw):  # positions as if one sequence
            pos = torch.arange(input_ids.shape[1])[None]
            return inner(input_ids=input_ids, position_ids=pos, use_cache=False)

        return forward


def test_a_model_that_cannot_pack_pads_and_says_so(caplog):
    assert pack_reason(_model()) is None
    assert "attend to each other" in pack_reason(_NoBoundaries(_model()))
    with caplog.at_level(logging.WARNING, logger="rlpost.train.packing"):
        assert not resolve_packing("on", _NoBoundaries(_model()))
        assert not resolve_packing("on", _model(), sharded=True)
        assert not resolve_packing("auto", _model())  # a 300-token vocabulary: padded, silently
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("train.packing=") for line in lines)
    assert "padding instead" in lines[0] and "\n" not in lines[0]
    assert not resolve_packing("off", _model())
    big = _model()
    big.config.vocab_size = packing.AUTO_MIN_VOCAB  # what auto reads; the probe stays in range
    assert resolve_packing("auto", big)
    with pytest.raises(ValueError, match=r"train\.packing=sometimes"):
        resolve_packing("sometimes", _model())
