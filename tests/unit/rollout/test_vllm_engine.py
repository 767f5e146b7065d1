"""The vLLM engine without vLLM: a one-line error naming the extra (runs on CPU)."""

import sys
from types import SimpleNamespace

import pytest

from rlpost.rollout import vllm_engine


def test_missing_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    cfg = SimpleNamespace(
        model=SimpleNamespace(path="x", dtype="float32"), rollout=SimpleNamespace()
    )
    with pytest.raises(ImportError) as err:
        vllm_engine.build(cfg, tokenizer=None)
    assert (
        str(err.value) == "rollout.engine=vllm needs the [vllm] extra: pip install 'rlpost[vllm]'"
    )
    with pytest.raises(ImportError, match=r"\[vllm\] extra"):
        vllm_engine.VLLMEngine("x", tokenizer=None)
