"""The large-vocabulary sampler: an exact draw from the tempered (filtered) distribution."""

import math

import torch

from rlpost.rollout.engines import protocol
from rlpost.rollout.engines.protocol import SamplingParams, inverse_cdf_sample, sample_tokens


def test_inverse_cdf_frequencies_follow_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.25, 0.05]]).repeat(40_000, 1)
    tokens = inverse_cdf_sample(probs, torch.Generator().manual_seed(3))
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    for p, f in zip(probs[0].tolist(), freq.tolist(), strict=True):
        sigma = math.sqrt(p * (1 - p) / len(tokens))
        assert abs(f - p) <= 5 * sigma + 1e-12  # a zero-probability token: never drawn
    assert freq[1] == 0


def test_inverse_cdf_is_seeded_and_never_picks_a_masked_token():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    masked = protocol.filter_logits(logits, top_k=5, top_p=1.0)
    probs = torch.softmax(masked, dim=-1)
    a = inverse_cdf_sample(probs, torch.Generator().manual_seed(7))
    b = inverse_cdf_sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert torch.isfinite(masked.gather(-1, a[:, None])).all()
    # unnormalised rows sample the same as their normalised form
    c = inverse_cdf_sample(probs * 3.0, torch.Generator().manual_seed(7))
    assert torch.equal(a, c)


def test_large_vocabularies_sample_by_inverse_cdf_small_ones_keep_multinomial(monkeypatch):
    params = SamplingParams(temperature=0.7, max_tokens=1)
    drawn: list[int] = []
    real = protocol.inverse_cdf_sample

    def spy(probs, generator):
        drawn.append(probs.shape[-1])
        return real(probs, generator)

    monkeypatch.setattr(protocol, "inverse_cdf_sample", spy)
    gen = torch.Generator().manual_seed(0)
    for vocab in (79, protocol.INVERSE_CDF_VOCAB):
        logits = torch.randn(4, vocab, generator=gen)
        tokens, logprobs = sample_tokens(logits, params, torch.Generator().manual_seed(1))
        full = torch.log_softmax(logits / 0.7, dim=-1)
        assert torch.allclose(logprobs, full.gather(-1, tokens[:, None]).squeeze(-1))
    assert drawn == [protocol.INVERSE_CDF_VOCAB]


def test_inverse_cdf_over_many_blocks_and_a_partial_tail():
    vocab = 3 * protocol._CDF_BLOCK + 37
    gen = torch.Generator().manual_seed(5)
    probs = torch.zeros(30_000, vocab)
    live = torch.tensor([3, protocol._CDF_BLOCK - 1, protocol._CDF_BLOCK, 2500, vocab - 1])
    weights = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.25])
    probs[:, live] = weights
    tokens = inverse_cdf_sample(probs, gen)
    assert set(tokens.unique().tolist()) <= set(live.tolist())
    freq = torch.stack([(tokens == t).double().mean() for t in live])
    sigma = (weights.double() * (1 - weights.double()) / len(tokens)).sqrt()
    assert ((freq - weights.double()).abs() <= 5 * sigma).all()
    # a row whose mass is all in the tail, and one all in the first block
    edge = torch.zeros(2, vocab)
    edge[0, vocab - 5] = 1.0
    edge[1, 0] = 2.0
    assert inverse_cdf_sample(edge, gen).tolist() == [vocab - 5, 0]


def test_a_uniform_at_the_top_lands_on_the_last_token_with_mass(monkeypatch):
    # u just below 1, and a block of little mass after a heavy one: the share of the block
    # left to draw rounds up to all of it, the very end of its CDF, past its last positive
    # token (zeros follow); the draw must stay on a token with mass
    block = protocol._CDF_BLOCK
    probs = torch.zeros(3, 2 * block)
    probs[:, 0] = 1.0
    probs[:, block : block + 10] = 1e-9 * torch.arange(1, 11)
    top = torch.full((3, 1), 1.0 - 2.0**-53, dtype=torch.float64)
    monkeypatch.setattr(protocol.torch, "rand", lambda *a, **k: top.clone())
    assert inverse_cdf_sample(probs, None).tolist() == [block + 9] * 3
