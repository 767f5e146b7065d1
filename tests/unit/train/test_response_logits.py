"""The trainer's logits: the LM head runs on the response positions only (``logits_to_keep``)
and gives what the full head gives there; a model without that argument gets the full head."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.bench_response_logits import FullHead as FullHeadOnly  # the head everywhere
from rlpost.train.batch import collate, keeps_logits, response_logits, token_logprobs
from rlpost.types import Completion


def _model(vocab: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    rows = []
    for p_len, r_len in [(7, 3), (2, 5), (5, 1)]:
        prompt = torch.randint(1, 512, (p_len,), generator=gen).tolist()
        response = torch.randint(1, 512, (r_len,), generator=gen).tolist()
        rows.append(Completion(prompt, response, [0.0] * r_len, "stop", 0, 0))
    return collate(rows, [1.0, 0.0, 1.0], 0)


def test_head_on_response_positions_only_matches_the_full_head():
    model, batch = _model(), _batch()
    assert keeps_logits(model) and not keeps_logits(FullHeadOnly(model))
    kept = response_logits(model, batch)
    full = response_logits(FullHeadOnly(model), batch)
    assert kept.shape == full.shape == (3, batch.responses.shape[1], 512)
    assert torch.allclose(kept, full, atol=1e-5, rtol=1e-5)
    by_hand = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    ).logits[:, batch.prompt_width - 1 : -1]
    assert torch.allclose(kept, by_hand, atol=1e-5, rtol=1e-5)
    lp = token_logprobs(kept, batch.responses)
    assert torch.allclose(lp, token_logprobs(by_hand, batch.responses), atol=1e-5)
