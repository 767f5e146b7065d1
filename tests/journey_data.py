"""A user's own model and data, built locally: a tiny Llama with a trained BPE tokenizer and a
chat template, and GSM8K-style JSONL rows. Nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlpost.models.tiny import build_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis"]
THINGS = ["clips", "apples", "books", "pages", "marbles", "stamps"]


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """Word problems with GSM8K's answer format: a worked solution ending in ``#### N``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = (
            f"{name} had {a} {thing} and got {b} more. How many {thing} does {name} have now?"
        )
        answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n#### {a + b}"
        rows.append({"question": question, "answer": answer})
    return rows


def save_bpe_checkpoint(out_dir: Path, corpus: list[str], *, max_positions: int = 256) -> Path:
    """A randomly initialised tiny Llama and a byte-level BPE tokenizer trained on ``corpus``,
    with a chat template, saved as an ordinary HF checkpoint directory."""
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(
        tok, hidden_size=32, intermediate_size=64, max_position_embeddings=max_positions
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def write_jsonl(path: Path, rows: list[dict], extra_lines: list[bytes] = ()) -> Path:
    lines = [json.dumps(r).encode() for r in rows] + list(extra_lines)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path
