"""The vLLM engine without vLLM: a one-line error naming the extra (runs on CPU)."""

import sys
from types import SimpleNamespace

import pytest
import torch

from rlpost.rollout.engines import vllm as vllm_engine


def test_missing_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    cfg = SimpleNamespace(
        model=SimpleNamespace(path="x", dtype="float32"), rollout=SimpleNamespace()
    )
    with pytest.raises(ImportError) as err:
        vllm_engine.build(cfg, None, None, tokenizer=None)
    assert (
        str(err.value) == "rollout.engine=vllm needs the [vllm] extra: pip install 'rlpost[vllm]'"
    )
    with pytest.raises(ImportError, match=r"\[vllm\] extra"):
        vllm_engine.VLLMEngine("x", tokenizer=None)


def test_vllm_logs_warnings_only_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    with pytest.raises(ImportError):
        vllm_engine._import_vllm()
    assert vllm_engine.os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with pytest.raises(ImportError):
        vllm_engine._import_vllm()
    assert vllm_engine.os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_worker_extension_path_names_the_loader():
    """vLLM imports the extension by this dotted path inside each worker."""
    import importlib

    from rlpost.rollout.engines.vllm_worker import WeightLoader

    module, _, name = vllm_engine.engine_args("m")["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightLoader


def test_weight_file_holds_every_tensor_tied_ones_too(tmp_path):
    """Tied weights share storage, which safetensors refuses; each name still arrives whole."""
    from safetensors.torch import load_file

    embed = torch.randn(5, 3)
    named = [("embed.weight", embed), ("head.weight", embed), ("w", torch.randn(3, 4).t())]
    path = vllm_engine.write_weights(named, tmp_path)
    loaded = load_file(path)
    assert sorted(loaded) == ["embed.weight", "head.weight", "w"]
    for name, t in named:
        assert torch.equal(loaded[name], t)
