"""The built-in tiny model: a real Llama architecture and a character tokenizer.

Saved as an ordinary HF directory. Llama, because with a Qwen2 config transformers loads Qwen's
tokenizer class and drops spaces and newlines. Characters (printable ASCII and newline) are
tokens, so every string round-trips.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer with one token per printable ASCII character (and newline)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; Fuse joins them back without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=4096,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 4,
    max_position_embeddings: int = 128,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama causal LM sized for CPU experiments."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def save_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, **shape: int) -> Path:
    """Build the tiny model and tokenizer and save them as an HF checkpoint directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **shape)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
