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


def test_a_tensor_parallel_size_that_cannot_split_the_heads_is_refused_in_one_line(monkeypatch):
    """SmolLM2's 9 heads and 3 KV heads: 3 ranks take 3 heads and one KV head each, 9 take
    one head and a copy of a KV head; 2 ranks cannot split them, refused before vLLM starts."""
    from transformers import LlamaConfig

    from rlpost.config import ConfigError

    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert vllm_engine.split_error(smol, 1) is None
    assert vllm_engine.split_error(smol, 3) is None
    assert vllm_engine.split_error(smol, 9) is None
    why = vllm_engine.split_error(smol, 2)
    assert why == (
        "rollout.engine.tensor_parallel_size=2: vLLM cannot split the model's 9 attention "
        "heads and 3 KV heads over 2 ranks; use one of 1, 3, 9"
    )
    no_gqa = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=None)
    assert vllm_engine.split_error(no_gqa, 4) is None and vllm_engine.split_error(no_gqa, 3)

    monkeypatch.setattr(vllm_engine, "_import_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda *a, **k: pytest.fail("vLLM started"))
    cfg = SimpleNamespace(
        model=SimpleNamespace(path="x", dtype="float32"),
        rollout=SimpleNamespace(engine=SimpleNamespace(tensor_parallel_size=2)),
    )
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.tensor_parallel_size=2: "):
        vllm_engine.build(cfg, None, SimpleNamespace(config=smol), tokenizer=None)
