"""Load a causal LM and its tokenizer from a local HF directory or a GGUF file.

``model.path`` names an HF checkpoint directory (config.json, weights, tokenizer) or a
``.gguf`` file (or a directory holding exactly one); :mod:`rlpost.models.gguf` reads the
latter into the same kind of float model. Nothing is fetched from a hub:
``local_files_only`` is always set, and a missing or unreadable model is a one-line
:class:`ModelLoadError`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from rlpost.errors import ModelLoadError, one_line, refuse_incomplete
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names, or None for an HF directory (or nothing)."""
    from rlpost.models import gguf

    return gguf.gguf_file(path)


def quiet_transformers() -> None:
    """Silence transformers' own info logs and progress bars ("Loading weights", "Writing
    model shards") in this process: rlpost's console says what a run is doing, and a worker
    process writes to the same terminal. Its warnings and errors still show."""
    import os

    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _checkpointing_prefix(model: PreTrainedModel) -> str:
    return "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"


def checkpointing_on(model: PreTrainedModel) -> bool:
    return bool(getattr(model, f"is_{_checkpointing_prefix(model)}_checkpointing", False))


def checkpointing(model: PreTrainedModel, enable: bool = True, *, reentrant: bool = True) -> None:
    """Gradient checkpointing on (or off) under transformers' current name for it,
    ``activation_checkpointing_*`` from 5.24, ``gradient_checkpointing_*`` before (vLLM's
    CPU build pins an older transformers in its environment)."""
    prefix = _checkpointing_prefix(model)
    if not enable:
        return getattr(model, f"{prefix}_checkpointing_disable")()
    kwargs = {} if reentrant else {f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}
    getattr(model, f"{prefix}_checkpointing_enable")(**kwargs)


def load_tokenizer(path: str | Path):
    if (file := _gguf(path)) is not None:
        from rlpost.models import gguf

        tok = gguf.load_tokenizer(file)
    else:
        p = check_model_path(path)
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot load a tokenizer from {str(p)!r}: {one_line(exc)}"
            ) from None
    if tok.pad_token_id is None:
        # Decoder-only checkpoints often ship without a pad token; padding is
        # always masked, so reusing EOS is safe.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_model_path(path: str | Path) -> Path:
    """``path`` as a Path if it is a directory with a config.json, or the GGUF file it
    names, readable by transformers (no weights are read)."""
    if (file := _gguf(path)) is not None:
        from rlpost.models import gguf

        return gguf.check(file)
    p = Path(path)
    if p.is_file():
        raise ModelLoadError(
            f"model path {str(p)!r} is a file but not a .gguf; name an HF checkpoint directory "
            "or a .gguf file"
        )
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise ModelLoadError(
            f"model directory {str(p)!r} has no config.json and no .gguf file; is it an HF "
            "checkpoint?"
        )
    return p


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(path: str | Path) -> int | None:
    """The longest sequence the checkpoint at ``path`` handles, read from its config.json
    or GGUF header (no weights are loaded); None when the config states none."""
    if (file := _gguf(path)) is not None:
        from rlpost.models import gguf

        return gguf.context_length(file)
    p = check_model_path(path)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(p / 'config.json')!r}: {one_line(exc)}") from None
    for section in (cfg, cfg.get("text_config") or {}):
        for key in POSITION_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def load_config(path: str | Path) -> PretrainedConfig:
    """The model's config (no weights are loaded)."""
    if (file := _gguf(path)) is not None:
        from rlpost.models import gguf

        return gguf.load_config(file)
    p = check_model_path(path)
    try:
        return AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read a config from {str(p)!r}: {one_line(exc)}") from None


def load_causal_lm(path: str | Path, *, dtype: str = "float32") -> PreTrainedModel:
    """The model at ``path`` (an HF directory or a GGUF file) in ``dtype``, every weight
    read from the checkpoint (:func:`~rlpost.errors.refuse_incomplete`)."""
    if (file := _gguf(path)) is not None:
        from rlpost.models import gguf

        return gguf.load_causal_lm(file, dtype=DTYPES[dtype])
    p = check_model_path(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            p, local_files_only=True, dtype=DTYPES[dtype], output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # a torn weights file too
        raise ModelLoadError(f"cannot load a causal LM from {str(p)!r}: {one_line(exc)}") from None
    refuse_incomplete(p, info)
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
