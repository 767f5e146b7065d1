"""SmolLM2-135M-Instruct, a real pretrained model, in and out of GGUF (CPU, minutes).

The wheel's Q4_1 GGUF reads as a 30-layer Llama with its ChatML template and ``<|im_end|>``
as EOS; its cached HF conversion is the same model; exported to GGUF and read back, it
gives the same logits on a chat prompt within each format's rounding."""

from __future__ import annotations

import pytest
import torch

from rlpost.models.export import export_model
from rlpost.models.loading import load_config, load_policy
from tests.real_model import smollm2_dir

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is 12 + 7? Answer with a number."}]

# Max |logit difference| over the prompt as a fraction of the largest |logit| (38 here).
# f32 is exact. f16 rounds each weight by at most 2^-11 relative; through 30 layers the
# logits move by about 2 such eps of the largest (measured 1.1e-3). q8_0 stores each block
# of 32 as int8 steps of absmax / 127: a typical weight, well below its block's max, is
# off by about 1 %, and the logits by about 9 * 2^-8 of the largest (measured 3.5e-2).
# The bounds leave ~3.5x room over what was measured.
TOLERANCE = {"f32": 1e-6, "f16": 8 * 2**-11, "q8_0": 32 * 2**-8}


def prompt_ids(tokenizer) -> torch.Tensor:
    out = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    return torch.tensor([out["input_ids"]])


@pytest.fixture(scope="module")
def smollm2():
    return load_policy(smollm2_dir())


def test_smollm2_is_a_chatml_llama_with_im_end_as_eos(smollm2):
    model, tok = smollm2
    c = load_config(smollm2_dir())
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
    assert shape == (30, 576, 9, 3) and c.vocab_size == 49152 and c.tie_word_embeddings
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    asked = [{"role": "user", "content": "What is 2+3?"}]
    ids = tok.apply_chat_template(asked, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(ids["input_ids"], max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :])
    assert answer == "2 + 3 = 5<|im_end|>"  # greedy: a working model stops at its EOS


def test_the_wheel_gguf_reads_as_the_cached_directory(smollm2):
    from rlpost.models.gguf import smollm2_gguf

    model, tok = smollm2
    direct, direct_tok = load_policy(smollm2_gguf())
    assert direct_tok.get_vocab() == tok.get_vocab()
    assert direct_tok.chat_template == tok.chat_template
    ids = prompt_ids(tok)
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_smollm2_gguf_round_trip(smollm2, tmp_path, kind):
    model, tok = smollm2
    out = export_model(model, tok, tmp_path / "out", gguf_type=kind, overwrite=False)
    back, back_tok = load_policy(out["gguf"])
    ids = prompt_ids(tok)
    assert prompt_ids(back_tok).tolist() == ids.tolist()
    assert back_tok.eos_token == "<|im_end|>" and back_tok.chat_template == tok.chat_template
    with torch.no_grad():
        want, got = model(ids).logits, back(ids).logits
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= TOLERANCE[kind] * scale
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
