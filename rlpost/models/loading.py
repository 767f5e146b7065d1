"""Load a Hugging Face causal LM and its tokenizer from a local directory.

Nothing is fetched from a hub: ``local_files_only`` is always set, and a
missing or unreadable directory is a one-line :class:`ModelLoadError`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rlpost.errors import one_line
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """A model directory that cannot be used, explained in one line."""


def quiet_transformers() -> None:
    """Silence transformers' own info logs and progress bars ("Loading weights", "Writing
    model shards") in this process: rlpost's console says what a run is doing, and a worker
    process writes to the same terminal. Its warnings and errors still show."""
    import os

    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(path: str | Path):
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model directory {str(p)!r} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {str(p)!r}: {one_line(exc)}") from None
    if tok.pad_token_id is None:
        # Decoder-only checkpoints often ship without a pad token; padding is
        # always masked, so reusing EOS is safe.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path if it is a directory with a config.json (no weights are read)."""
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise ModelLoadError(
            f"model directory {str(p)!r} has no config.json; is it an HF checkpoint?"
        )
    return p


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(path: str | Path) -> int | None:
    """The longest sequence the checkpoint at ``path`` handles, read from its config.json
    (no weights are loaded); None when the config states none."""
    p = check_model_dir(path)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(p / 'config.json')!r}: {one_line(exc)}") from None
    for section in (cfg, cfg.get("text_config") or {}):
        for key in POSITION_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def load_causal_lm(path: str | Path, *, dtype: str = "float32") -> PreTrainedModel:
    p = check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=DTYPES[dtype])
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # a torn weights file too
        raise ModelLoadError(f"cannot load a causal LM from {str(p)!r}: {one_line(exc)}") from None
    return model


def load_policy(
    path: str | Path | None,
    *,
    tiny_shape: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
):
    """(model, tokenizer): from ``path``, or the built-in tiny model when path is None."""
    if path is None:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, seed=seed, **(tiny_shape or {}))
        return model.to(DTYPES[dtype]), tokenizer
    return load_causal_lm(path, dtype=dtype), load_tokenizer(path)


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A detached, eval-mode copy whose parameters never receive gradients (reference policy)."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref
