"""Packed passes: the rows end to end with restarting positions, and the rows of one prompt
after a single copy of it, give the padded numbers (logprobs, entropy, gradients, values,
whole updates), and a model that cannot pack pads with one warning line."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpost.algos import get_advantage_estimator, scores_to_token_rewards
from rlpost.config import OptimConfig
from rlpost.params import PPOClipParams
from rlpost.train import packing
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.batch import FULL_LOGITS, collate, response_logprobs, response_sum_pi_squared
from rlpost.train.critic import CriticTrainer, ValueModel
from rlpost.train.optim import budget_slices, shuffled_rows
from rlpost.train.packing import Pack, pack_reason, pack_rows, resolve_packing
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
        optim=OptimConfig(lr=1e-3),
        mini_batch_size=8,
        micro_batch_size=micro,
        max_tokens_per_micro_batch=budget,
        entropy_coef=0.01,
        packing=packing,
    )
    return PolicyTrainer(model, PPOClipParams(), s)


def _same_update(ta: PolicyTrainer, tc: PolicyTrainer, b, base) -> None:
    """``ta`` and ``tc`` (trainers of copies of ``base``) give ``b`` the same old logprobs,
    loss, entropy and weights, and the weights moved."""
    b1, b2 = copy.deepcopy(b), copy.deepcopy(b)
    b1.old_logprobs, b2.old_logprobs = ta.old_logprobs(b1), tc.old_logprobs(b2)
    mask = b.response_mask.bool()
    torch.testing.assert_close(b1.old_logprobs[mask], b2.old_logprobs[mask], atol=1e-5, rtol=0)
    s1, s2 = ta.update(b1).stats, tc.update(b2).stats
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-5)
    assert s1["entropy"] == pytest.approx(s2["entropy"], abs=1e-5)
    a, c = ta.model, tc.model
    moved = max((p - q).abs().max() for p, q in zip(a.parameters(), base.parameters(), strict=True))
    assert moved > 1e-4
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("micro", "budget"), [(8, 0), (3, 0), (8, 40)])
def test_packed_update_equals_the_padded_update(micro, budget):
    """Two optimizer steps: the same old logprobs, losses and weights as one padded
    micro-batch per mini-batch, whether packed micro-batches hold 8 rows, 3 or a budget."""
    base, b = _model(), _batch(16)
    a, c = copy.deepcopy(base), copy.deepcopy(base)
    ta, tc = _trainer(a, "on", micro, budget), _trainer(c, "off", 8)
    assert ta.packed and not tc.packed
    _same_update(ta, tc, b, base)


def test_packed_critic_values_and_update_equal_padded():
    base, b = _model(), _batch(16)
    b.returns = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(3))

    def critic(packing, micro, budget=0):
        torch.manual_seed(5)  # the same value head
        return CriticTrainer(
            ValueModel.from_policy(copy.deepcopy(base)),
            optim=OptimConfig(lr=1e-3),
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
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("train.packing=") for line in lines)
    assert "padding instead" in lines[0] and "\n" not in lines[0]
    assert not resolve_packing("off", _model())
    assert resolve_packing("auto", _model()) is Pack.SHARED
    assert resolve_packing("on", _model()) is Pack.ROWS
    with pytest.raises(ValueError, match=r"train\.packing=sometimes"):
        resolve_packing("sometimes", _model())


# ------------------------------------------------------------------ shared prompts


def _grouped_batch():
    """Three prompts: four rows of one (mixed lengths, a loss-masked row, a fully masked
    row), two of another, one alone; the rows of a group not next to each other."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 2, 4)]
    spec = [(0, 3, None), (1, 7, None), (0, 6, [1, 0, 1, 1, 0, 1]), (2, 5, None), (0, 1, [0]),
            (1, 2, None), (0, 4, None)]  # fmt: skip
    rows = []
    for g, r_len, mask in spec:
        response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
        rows.append(Completion(prompts[g], response, [-1.0] * r_len, "stop", 0, g, loss_mask=mask))
    b = collate(rows, [float(i % 3 == 0) for i in range(len(rows))], 0)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


def test_shared_prompts_run_each_prompt_once():
    b = _grouped_batch()
    rows = pack_rows(b, shared=True)
    p_lens, r_lens = b.lengths()
    prompts = {g: int(p_lens[b.group == g][0]) for g in b.group.tolist()}
    assert rows.input_ids.shape == (1, sum(prompts.values()) + int(r_lens.sum()))
    torch.testing.assert_close(rows.targets, b.responses[rows.where])
    ids, mask = rows.input_ids[0], rows.mask[0, 0]
    for i in range(len(b)):  # what the place predicting each response token sees
        p, real = int(p_lens[i]), b.input_ids[i][b.attention_mask[i].bool()]
        places = rows.at[torch.cat([r_lens[:i].sum()[None], r_lens[i : i + 1]]).cumsum(0)[0] :][
            : int(r_lens[i])
        ]
        for t, q in enumerate(places.tolist()):
            # the prompt and the row's own tokens up to t - 1, in order: the row's prefix
            torch.testing.assert_close(ids[mask[q]], real[: p + t])
            assert rows.position_ids[0, q] == p + t - 1
    # without sharing (or with no two rows of one prompt) the layout is the rows' own
    plain = pack_rows(b)
    assert plain.mask is None and plain.input_ids.shape[1] == int((p_lens + r_lens).sum())
    assert pack_rows(b.select(torch.tensor([0, 1, 3])), shared=True).mask is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("chunk", "line_tokens"), [(FULL_LOGITS, 0), (0, 0), (4, 0), (0, 12)])
def test_shared_prompts_give_the_padded_logprobs_and_grads(attn, chunk, line_tokens, monkeypatch):
    """Also in sequences of 12 tokens, where the four-row group is longer than one."""
    monkeypatch.setattr(packing, "LINE_TOKENS", line_tokens or packing.LINE_TOKENS)
    model, b, tau = _model(attn), _grouped_batch(), 0.8
    real = b.attention_mask[:, b.prompt_width :].bool()

    def run(packed):
        return response_logprobs(model, b, tau, with_entropy=True, chunk=chunk, packed=packed)

    (lp, ent), (slp, sent) = run(Pack.PADDED), run(Pack.SHARED)
    torch.testing.assert_close(slp[real], lp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sent[real], ent[real], atol=1e-5, rtol=1e-5)
    assert (slp[~real] == 0).all()
    mask = b.response_mask
    padded = _grads(model, lambda: run(Pack.PADDED), mask)
    shared = _grads(model, lambda: run(Pack.SHARED), mask)
    assert padded.keys() == shared.keys()
    for name, g in padded.items():
        torch.testing.assert_close(shared[name], g, atol=1e-5, rtol=1e-4, msg=name)
    pi2 = response_sum_pi_squared(model, b, tau, chunk=chunk)
    spi2 = response_sum_pi_squared(model, b, tau, chunk=chunk, packed=Pack.SHARED)
    torch.testing.assert_close(spi2[real], pi2[real], atol=1e-6, rtol=1e-5)


def test_shuffles_and_budgets_keep_a_group_together():
    groups = torch.tensor([0, 1, 0, 2, 1, 0, 2, 2])
    order = shuffled_rows(8, torch.Generator().manual_seed(0), groups)
    assert sorted(order.tolist()) == list(range(8))
    runs = [int(groups[r]) for r in order]
    assert [g for k, g in enumerate(runs) if k == 0 or g != runs[k - 1]] == sorted(
        set(runs), key=runs.index
    )
    for g in range(3):  # each group's rows in their own order
        assert [r for r in order.tolist() if groups[r] == g] == (
            groups == g
        ).nonzero().flatten().tolist()
    # a budget counts a group's prompt once: group 0 (prompt 10, responses 2 + 2 + 2) fits 16
    prompt = torch.tensor([10, 3, 10, 4, 3, 10, 4, 4])
    response = torch.tensor([2, 1, 2, 3, 1, 2, 2, 1])
    slices = budget_slices(
        torch.arange(8), prompt, response, 8, 16, packed=Pack.SHARED, groups=groups
    )
    assert sorted(torch.cat(slices).tolist()) == list(range(8))
    assert [0, 2, 5] in [sorted(s.tolist()) for s in slices]
    for s in slices:
        prompts = sum(int(prompt[(groups == g).nonzero()[0]]) for g in set(groups[s].tolist()))
        assert len(s) == 1 or prompts + int(response[s].sum()) <= 16
    # counting every row's prompt, the same budget cannot hold group 0
    apart = budget_slices(torch.arange(8), prompt, response, 8, 16, packed=Pack.ROWS)
    assert [0, 2, 5] not in [sorted(s.tolist()) for s in apart]


@pytest.mark.parametrize(("micro", "budget"), [(7, 0), (3, 0), (7, 30)])
def test_shared_update_equals_the_padded_update(micro, budget):
    """Two epochs of one mini-batch (its row order does not change the sums), micro-batches
    of 7 rows, 3 rows (groups cut in two) or a token budget."""
    base, b = _model(), _grouped_batch()
    a, c = copy.deepcopy(base), copy.deepcopy(base)

    def trainer(model, packing, micro, budget=0):
        s = ActorSettings(optim=OptimConfig(lr=1e-3), mini_batch_size=7, micro_batch_size=micro, epochs=2,
                          max_tokens_per_micro_batch=budget, entropy_coef=0.01, packing=packing)  # fmt: skip
        return PolicyTrainer(model, PPOClipParams(), s)

    ta, tc = trainer(a, "shared", micro, budget), trainer(c, "off", 7)
    assert ta.packed is Pack.SHARED and tc.packed is Pack.PADDED
    _same_update(ta, tc, b, base)


def test_shared_critic_values_equal_padded():
    base, b = _model(), _grouped_batch()

    def critic(packing):
        torch.manual_seed(5)  # the same value head
        return CriticTrainer(
            ValueModel.from_policy(copy.deepcopy(base)), optim=OptimConfig(lr=1e-3), packing=packing
        )

    shared, padded = critic("shared"), critic("off")
    assert shared.packed is Pack.SHARED
    torch.testing.assert_close(shared.values(b), padded.values(b), atol=1e-5, rtol=1e-5)


class _NoMask(torch.nn.Module):
    """A causal LM stand-in whose attention drops a custom 4-D mask (reads positions only)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def get_decoder(self):
        inner = self.inner.get_decoder()

        def forward(attention_mask=None, **kw):
            return inner(attention_mask=None, **kw)

        return forward


def test_an_attention_without_custom_masks_packs_rows_alone(caplog):
    model = _NoMask(_model())
    assert pack_reason(model) is None
    assert "attend to each other" in pack_reason(model, shared=True)
    # flex and flash attention take no custom mask: refused without a probe
    assert "custom 4-D mask" in pack_reason(_model("flex_attention"), shared=True)
    with caplog.at_level(logging.WARNING, logger="rlpost.train.packing"):
        assert resolve_packing("shared", model) is Pack.ROWS
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("train.packing=shared: rows packed")
    assert "\n" not in lines[0]


def test_line_width_keeps_the_dense_attention_a_small_share():
    """W keys a query costs 4 H W FLOPs against a layer's 2 (4 H^2 + 3 H I) a token."""
    model = _model()  # hidden 32, MLP 64: 2 (4096 + 6144) = 20,480 FLOPs a token
    assert packing.line_tokens(model) == round(0.05 * 20_480 / 128)  # 8 tokens
    cfg = copy.deepcopy(model.config)
    cfg.hidden_size, cfg.intermediate_size = 4096, 11008  # a 7B's widths
    wide = torch.nn.Module()
    wide.config = cfg
    assert 1_100 < packing.line_tokens(wide) < 1_300
    cfg.hidden_size, cfg.intermediate_size = 65_536, 4 * 65_536
    assert packing.line_tokens(wide) == packing.LINE_TOKENS  # capped
    b = _batch(8)
    rows = pack_rows(b, packing.line_tokens(model))
    lengths = (b.attention_mask.sum(-1)).tolist()
    assert rows.input_ids.shape[1] == max(max(lengths), 8)  # a longer row is a line alone
    assert rows.input_ids.shape[0] > 1
