"""The chunked LM head gives the full-logits path's logprobs, entropy and gradients (fp32,
1e-5), with masked tokens, a fully masked row and tied embeddings, in any chunk size."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpost.algos.entropy import entropy_from_logits
from rlpost.train.batch import (
    FULL_LOGITS,
    collate,
    compute_logprobs,
    response_logits,
    response_logprobs,
    response_sum_pi_squared,
    token_logprobs,
)
from rlpost.train.lm_head import head_logprobs, head_sum_pi_squared, split_head
from rlpost.types import Completion

VOCAB = 300


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of a useful spread (a fresh head gives near-uniform ones)
        model.lm_head.weight.mul_(10.0)
    return model


def _batch():
    """Rows of different lengths, one with loss-masked tokens and one fully masked."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for p_len, r_len, mask in [(7, 3, None), (2, 6, [1, 0, 0, 1, 1, 0]), (5, 2, [0, 0])]:
        prompt = torch.randint(1, VOCAB, (p_len,), generator=gen).tolist()
        response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
        rows.append(Completion(prompt, response, [0.0] * r_len, "stop", 0, 0, loss_mask=mask))
    return collate(rows, [1.0, 0.0, 1.0], 0)


def _full(model, batch, temperature):
    logits = response_logits(model, batch)
    return token_logprobs(logits, batch.responses, temperature), entropy_from_logits(
        logits / temperature
    )


def _grads(model, fn, batch):
    """Gradients of a loss that weights logprobs and entropy by the response mask."""
    model.zero_grad()
    lp, ent = fn()
    mask = batch.response_mask
    ((lp * mask).sum() * 0.7 - (ent * mask).sum() * 0.3).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the ops that run under it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _ran_onednn(fn) -> bool:
    with _Ops() as ops:
        fn()
    return "mkldnn._linear_pointwise" in ops.names


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_matches_full_logits(tied, chunk):
    model, batch, temperature = _model(tied), _batch(), 0.8
    assert split_head(model) is not None
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    lp_full, ent_full = _full(model, batch, temperature)
    lp, ent = response_logprobs(model, batch, temperature, with_entropy=True, chunk=chunk)
    torch.testing.assert_close(lp[real], lp_full[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[real], ent_full[real], atol=1e-5, rtol=1e-5)
    assert (lp[~real] == 0).all() and (ent[~real] == 0).all()
    assert ent[real].std() > 0.1  # the case is not a uniform distribution

    full = _grads(model, lambda: _full(model, batch, temperature), batch)
    chunked = _grads(
        model,
        lambda: response_logprobs(model, batch, temperature, with_entropy=True, chunk=chunk),
        batch,
    )
    assert full.keys() == chunked.keys() and "model.embed_tokens.weight" in full
    for name, grad in full.items():
        torch.testing.assert_close(chunked[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert full["model.embed_tokens.weight"].abs().max() > 1e-3


@pytest.mark.parametrize("onednn", [False, True])
def test_hidden_and_weight_gradients_against_autograd_of_the_formula(onednn, monkeypatch):
    """With every head past oneDNN's size: on oneDNN's kernel (its forward and its recompute,
    as on an AMD CPU), or on MKL's into the pass's buffer (as on an Intel one)."""
    from rlpost.train import lm_head

    monkeypatch.setattr(lm_head, "ONEDNN_MIN_VOCAB", 1)
    monkeypatch.setattr(lm_head, "_intel_cpu", lambda: not onednn)
    lm_head._onednn_linear()  # the probe's own call is not the pass's
    torch.manual_seed(3)
    hidden = torch.randn(11, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50, bias=True)
    targets = torch.randint(0, 50, (11,))
    g_lp, g_ent = torch.randn(11), torch.randn(11)

    def run():
        return head_logprobs(hidden, head, targets, temperature=0.6, with_entropy=True, chunk=3)

    assert _ran_onednn(run) == (onednn and lm_head._onednn_linear())
    lp, ent = run()
    (lp @ g_lp + ent @ g_ent).backward()
    mine = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None
    z = head(hidden) / 0.6
    ref_lp = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    (ref_lp @ g_lp + ref_ent @ g_ent).backward()
    for a, b in zip(mine, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _Fresh(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that return a new tensor of ``width`` columns (no out=, not in place),
    and every op by name."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.fresh, self.calls = width, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        is_new = func._overloadname in ("default", "memory_format") and not name.endswith("_")
        if is_new and isinstance(out, torch.Tensor) and out.dim() == 2 and not func.is_view:
            self.fresh += out.shape[-1] == self.width
        return out


def _head_pass(tokens: int, with_entropy: bool, use_entropy: bool, chunk: int = 3) -> _Fresh:
    torch.manual_seed(5)
    hidden = torch.randn(tokens, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50, bias=True)
    targets = torch.randint(0, 50, (tokens,))
    with _Fresh(50) as seen:
        lp, ent = head_logprobs(hidden, head, targets, with_entropy=with_entropy, chunk=chunk)
        (lp.sum() + (ent.sum() if use_entropy else 0)).backward()
    return seen


@pytest.mark.parametrize("with_entropy", [False, True])
def test_a_pass_reuses_its_logits_buffers_whatever_its_chunk_count(with_entropy, monkeypatch):
    """No [c, V] tensor is made per chunk (MKL's kernel into the pass's buffers)."""
    from rlpost.train import lm_head

    monkeypatch.setattr(lm_head, "_intel_cpu", lambda: True)
    few, many = (
        _head_pass(12, with_entropy, with_entropy),
        _head_pass(30, with_entropy, with_entropy),
    )
    assert many.calls["aten.mm"] > few.calls["aten.mm"]  # more chunks ran
    assert few.fresh == many.fresh <= 4  # a pass's logits and probabilities, forward and back


def test_an_unused_entropy_output_costs_no_backward_work():
    logged = _head_pass(12, with_entropy=True, use_entropy=False)
    trained = _head_pass(12, with_entropy=True, use_entropy=True)
    plain = _head_pass(12, with_entropy=False, use_entropy=False)
    # the forward's entropy is one exp a chunk; the trained entropy's gradient one more
    assert plain.calls.get("aten.exp", 0) == 0
    assert logged.calls["aten.exp"] == 4 and trained.calls["aten.exp"] == 8


def test_logprobs_only_backward_and_scoring_pass():
    model, batch = _model(True), _batch()
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    lp, ent = response_logprobs(model, batch, 1.0, chunk=2)
    assert ent is None
    (lp * batch.response_mask).sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    scored = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=2)
    full = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=2, chunk=FULL_LOGITS)
    torch.testing.assert_close(scored[real], full[real], atol=1e-5, rtol=1e-5)


def test_sum_pi_squared_matches_the_softmax():
    model, batch = _model(False), _batch()
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    with torch.no_grad():
        mine = response_sum_pi_squared(model, batch, 0.7, chunk=3)
        full = response_sum_pi_squared(model, batch, 0.7, chunk=FULL_LOGITS)
    torch.testing.assert_close(mine[real], full[real], atol=1e-6, rtol=1e-5)
    assert (mine[real] > 1.0 / VOCAB).all()
    hidden = torch.randn(4, 32)
    direct = head_sum_pi_squared(hidden, model.lm_head, temperature=1.0)
    expected = torch.softmax(model.lm_head(hidden), -1).pow(2).sum(-1)
    torch.testing.assert_close(direct, expected.detach(), atol=1e-6, rtol=1e-5)


def test_bf16_autocast_follows_the_full_path():
    model, batch = _model(False), _batch()
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_full = token_logprobs(response_logits(model, batch), batch.responses)
        lp, _ = response_logprobs(model, batch, 1.0, chunk=2)
    # bf16 logits of magnitude ~10 round at ~0.05; both paths round the same matmul.
    torch.testing.assert_close(lp[real], lp_full[real], atol=0.1, rtol=0.02)
    # the head's float32 weight gradient: the chunks' against float32's own, at bf16's rounding
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = response_logprobs(model, batch, 1.0, chunk=2)
    lp[real].sum().backward()
    mine = model.lm_head.weight.grad.clone()
    model.zero_grad()
    lp, _ = response_logprobs(model, batch, 1.0, chunk=FULL_LOGITS)
    lp[real].sum().backward()
    torch.testing.assert_close(mine, model.lm_head.weight.grad, atol=0.05, rtol=0.05)


def test_the_onednn_probe_runs_first_under_bf16_autocast(monkeypatch):
    """A trainer in bf16 autocast may be the first to ask whether oneDNN's kernel works: the
    probe's own matmul must not come out in bf16 (it did, and every bf16 run failed)."""
    from rlpost.train import lm_head

    monkeypatch.setattr(lm_head, "ONEDNN_MIN_VOCAB", 1)
    lm_head._onednn_linear.cache_clear()
    try:
        model, batch = _model(False), _batch()
        real = batch.attention_mask[:, batch.prompt_width :].bool()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = response_logprobs(model, batch, 1.0, chunk=2)
            lp_full = token_logprobs(response_logits(model, batch), batch.responses)
        torch.testing.assert_close(lp[real], lp_full[real], atol=0.1, rtol=0.02)
        assert lm_head._onednn_linear() == torch.backends.mkldnn.is_available()
    finally:
        lm_head._onednn_linear.cache_clear()


def test_a_head_that_cannot_be_split_keeps_the_full_path():
    from bench.bench_response_logits import FullHead

    model, batch = _model(False), _batch()
    wrapped = FullHead(model)
    assert split_head(wrapped) is None
    lp, _ = response_logprobs(wrapped, batch, 1.0)
    assert lp.shape == batch.responses.shape
    model.config.final_logit_softcapping = 30.0
    assert split_head(model) is None


def test_auto_chunking_only_where_the_logits_exceed_a_chunk(monkeypatch):
    from rlpost.train import lm_head

    model, batch = _model(False), _batch()
    real = batch.attention_mask[:, batch.prompt_width :].bool()
    full, _ = response_logprobs(model, batch, 1.0, chunk=FULL_LOGITS)
    small, _ = response_logprobs(model, batch, 1.0)  # fits one chunk: the one-matmul head
    assert torch.equal(small, full)
    assert not lm_head.needs_chunks(len(batch) * batch.responses.shape[1], VOCAB)
    monkeypatch.setattr(lm_head, "CHUNK_BYTES", 4 * VOCAB * 2)  # two tokens a chunk
    assert lm_head.chunk_tokens(VOCAB) == 2 and lm_head.needs_chunks(3, VOCAB)
    chunked, _ = response_logprobs(model, batch, 1.0)
    assert not torch.equal(chunked[~real], full[~real])  # padding left out: 0 there
    torch.testing.assert_close(chunked[real], full[real], atol=1e-5, rtol=1e-5)


def test_head_linear_takes_onednn_for_a_large_vocabulary_without_a_gradient():
    from rlpost.train import lm_head

    torch.manual_seed(0)
    x, big = torch.randn(5, 16), torch.randn(lm_head.ONEDNN_MIN_VOCAB, 16)
    small, bias = big[:300].clone(), torch.randn(300)
    want = torch.nn.functional.linear(x, big)
    if not lm_head._onednn_linear():  # a torch build without oneDNN: torch's own, exactly
        assert torch.equal(lm_head.head_linear(x, big), want)
        return
    assert _ran_onednn(lambda: lm_head.head_linear(x, big))
    torch.testing.assert_close(lm_head.head_linear(x[None], big)[0], want, atol=1e-5, rtol=1e-5)
    # a small head, a gradient wanted, or another dtype: torch's kernel, the exact numbers
    assert not _ran_onednn(lambda: lm_head.head_linear(x, small, bias))
    assert torch.equal(
        lm_head.head_linear(x, small, bias), torch.nn.functional.linear(x, small, bias)
    )
    wanted = x.clone().requires_grad_()
    assert not _ran_onednn(lambda: lm_head.head_linear(wanted, big))
    assert not _ran_onednn(lambda: lm_head.head_linear(x.double(), big.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_linear_takes_a_strided_last_position_as_rows(dtype):
    """``hidden[:, -1:]`` of a padded prompt batch: one matmul over its rows, never a batched
    one over the weight expanded per row (a bf16 CPU kernel copies that expansion out)."""
    from rlpost.train import lm_head

    torch.manual_seed(0)
    hidden = torch.randn(6, 9, 16, dtype=dtype)
    weight = torch.randn(lm_head.ONEDNN_MIN_VOCAB, 16, dtype=dtype)
    last = hidden[:, -1:, :]
    assert not last.is_contiguous()
    with _Ops() as ops:
        got = lm_head.head_linear(last, weight)
    assert "aten.bmm" not in ops.names and "aten.expand" not in ops.names
    assert got.shape == (6, 1, lm_head.ONEDNN_MIN_VOCAB)
    want = torch.nn.functional.linear(last.contiguous().float(), weight.float())
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_a_serving_head_keeps_its_weights_ties_and_numbers(monkeypatch):
    import copy
    import pickle

    from rlpost.train import lm_head

    model = _model(True)
    ids = torch.arange(1, 9)[None]
    before = model(input_ids=ids).logits.detach()
    keys = list(model.state_dict())
    assert lm_head.serve_head(model) is model
    assert type(model.lm_head) is lm_head.ServingHead
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds
    assert list(model.state_dict()) == keys
    assert torch.equal(model(input_ids=ids).logits, before)  # a 300-token head: torch's kernel
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(other.lm_head) is lm_head.ServingHead
    monkeypatch.setattr(lm_head, "ONEDNN_MIN_VOCAB", 1)
    with torch.no_grad():
        assert _ran_onednn(lambda: model(input_ids=ids)) == lm_head._onednn_linear()
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    # the trainer's pass with a gradient keeps autograd's linear
    model(input_ids=ids).logits.sum().backward()
    assert model.lm_head.weight.grad is not None
