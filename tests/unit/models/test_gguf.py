"""GGUF in and out with the tiny model (CPU, seconds): export, read back through
transformers' GGUF loader, same tokens and the same logits within the format's error."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from rlpost.models import gguf as gguf_source
from rlpost.models.export import export_model, permute_for_llama_cpp
from rlpost.models.loading import (
    ModelLoadError,
    check_model_path,
    context_length,
    load_causal_lm,
    load_config,
    load_policy,
    load_tokenizer,
)
from rlpost.models.tiny import build_char_tokenizer

TEXT = "12+7= 19\nab-c*{x}!"

# Max |logit difference| allowed, as a multiple of the largest |logit|. Each weight is
# rounded with relative error at most eps (f16: 2^-11, bf16: 2^-8; q8_0: a block's scale is
# its absmax / 127, so an element is off by at most absmax / 254, about 2^-8 of the block's
# largest). The errors of a few hundred products per dot product partly cancel, and two
# layers compound them; 4 * eps bounds what the tiny model shows with room to spare.
TOLERANCE = {"f32": 1e-6, "f16": 4 * 2**-11, "bf16": 4 * 2**-8, "q8_0": 4 * 2**-8}


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_policy(tiny_dir)


def logits(model, tokenizer, text=TEXT):
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return ids, model(input_ids=ids).logits


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_exported_gguf_reads_back_with_the_same_logits(policy, tmp_path, kind):
    model, tok = policy
    out = export_model(model, tok, tmp_path / "out", gguf_type=kind, overwrite=False)
    back, back_tok = load_policy(out["gguf"])
    ids, want = logits(model, tok)
    back_ids, got = logits(back, back_tok)
    assert back_ids.tolist() == ids.tolist()
    assert back_tok.decode(back_ids[0]) == TEXT
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= TOLERANCE[kind] * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert out["hf_dir"] == tmp_path / "out" and (tmp_path / "out" / "config.json").is_file()


def test_gguf_keeps_the_special_tokens_and_context(policy, tmp_path, capsys):
    model, tok = policy
    out = export_model(model, tok, tmp_path / "out", gguf_type="f32", overwrite=False)
    # the character vocabulary has no merges, which llama.cpp requires
    assert "llama.cpp refuses it" in capsys.readouterr().err
    back = load_tokenizer(out["gguf"])
    for kind in ("eos", "pad", "bos"):
        assert getattr(back, f"{kind}_token_id") == getattr(tok, f"{kind}_token_id"), kind
    assert back.padding_side == "left"
    assert context_length(out["gguf"]) == model.config.max_position_embeddings
    assert context_length(out["gguf"].parent) == model.config.max_position_embeddings
    conf = load_config(out["gguf"])
    assert conf.num_hidden_layers == model.config.num_hidden_layers
    assert not hasattr(conf, "quantization_config")


def test_gguf_model_saves_as_a_plain_checkpoint(policy, tmp_path):
    model, tok = policy
    out = export_model(model, tok, tmp_path / "out", gguf_type="q8_0", overwrite=False)
    loaded = load_causal_lm(out["gguf"])
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    loaded.save_pretrained(tmp_path / "again")
    # a checkpoint that claimed GGUF quantization would be reloaded as one
    assert "quantization_config" not in (tmp_path / "again" / "config.json").read_text()
    again = load_causal_lm(tmp_path / "again")
    for (name, a), b in zip(loaded.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_q_and_k_are_permuted_for_llama_cpp(policy, tmp_path):
    import gguf

    model, tok = policy
    out = export_model(model, tok, tmp_path / "out", gguf_type="f32", overwrite=False)
    tensors = {t.name: t for t in gguf.GGUFReader(out["gguf"]).tensors}
    q = model.model.layers[0].self_attn.q_proj.weight.detach()
    stored = torch.from_numpy(np.array(tensors["blk.0.attn_q.weight"].data))
    heads = model.config.num_attention_heads
    assert torch.equal(stored, permute_for_llama_cpp(q, heads))
    assert not torch.equal(stored, q)
    # llama.cpp's layout interleaves each head's two rotary halves: row 1 is HF's row hd/2
    half = q.shape[0] // heads // 2
    assert torch.equal(stored[1], q[half])


def test_export_refuses_an_existing_out_and_a_non_llama_model(policy, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model, tok = policy
    (tmp_path / "taken").mkdir()
    with pytest.raises(ModelLoadError, match="exists; choose another or pass --overwrite"):
        export_model(model, tok, tmp_path / "taken", gguf_type="f32", overwrite=False)
    export_model(model, tok, tmp_path / "taken", gguf_type="f32", overwrite=True)
    assert (tmp_path / "taken" / "gguf" / "model-f32.gguf").is_file()
    qwen = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="model_type 'qwen2'") as err:
        export_model(qwen, build_char_tokenizer(), tmp_path / "q", gguf_type="f16", overwrite=False)
    assert "\n" not in str(err.value) and not (tmp_path / "q").exists()


def test_a_directory_with_several_gguf_files_is_refused(policy, tmp_path):
    model, tok = policy
    out = export_model(model, tok, tmp_path / "out", gguf_type="f16", overwrite=False)
    (out["gguf"].parent / "copy.gguf").write_bytes(out["gguf"].read_bytes())
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files") as err:
        check_model_path(out["gguf"].parent)
    assert "\n" not in str(err.value)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelLoadError, match=r"is a file but not a \.gguf"):
        check_model_path(tmp_path / "notes.txt")


def _write_llama_gguf(path, model, tok, arch="llama", bad_type=None):
    """A GGUF of ``model`` with its own architecture name, one tensor stored in ``bad_type``."""
    import gguf

    from rlpost.models.export import write_config, write_tensors, write_tokenizer

    writer = gguf.GGUFWriter(str(path), arch)
    write_config(writer, model.config, "f32")
    write_tokenizer(writer, tok, model.config.vocab_size)
    write_tensors(writer, model, "f32")
    if bad_type is not None:
        del writer.tensors[0]["token_embd.weight"]
        writer.add_tensor("token_embd.weight", np.zeros((10, 292), np.uint8), raw_dtype=bad_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unreadable_architecture_and_quantization_are_one_line(policy, tmp_path):
    import gguf

    model, tok = policy
    rwkv = _write_llama_gguf(tmp_path / "rwkv.gguf", model, tok, arch="rwkv6")
    with pytest.raises(ModelLoadError, match="architecture 'rwkv6', which transformers cannot"):
        check_model_path(rwkv)
    (tmp_path / "q").mkdir()
    q8k = _write_llama_gguf(tmp_path / "q" / "m.gguf", model, tok,
                            bad_type=gguf.GGMLQuantizationType.Q8_K)  # fmt: skip
    with pytest.raises(ModelLoadError) as err:
        load_causal_lm(q8k)
    assert "cannot load a causal LM" in str(err.value) and "\n" not in str(err.value)


def test_missing_gguf_package_names_the_install(policy, tmp_path, monkeypatch):
    model, tok = policy
    out = export_model(model, tok, tmp_path / "out", gguf_type="f32", overwrite=False)
    gguf_source._header.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ModelLoadError, match=r"needs gguf: pip install 'rlpost\[gguf\]'"):
        check_model_path(out["gguf"])


@pytest.fixture(scope="module")
def good_gguf(policy, tmp_path_factory):
    """The tiny model's f32 GGUF, as bytes: two blocks, 20 tensors."""
    model, tok = policy
    out = tmp_path_factory.mktemp("good") / "out"
    return export_model(model, tok, out, gguf_type="f32", overwrite=False)["gguf"].read_bytes()


def _value_at(blob: bytes, key: str) -> int:
    """Offset of metadata ``key``'s value type (its value follows 4 bytes on)."""
    name = key.encode()
    return blob.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def _patched(blob: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def _tensor_at(blob: bytes, name: str) -> int:
    """Offset of tensor ``name``'s dimension count in the tensor table."""
    return blob.index(name.encode()) + len(name)


# name -> (the good file's bytes -> the malformed file's bytes, what the line must say)
MALFORMED = {
    "empty": (lambda b: b"", "cannot mmap an empty file"),
    "cut in the header": (lambda b: b[:100], "cannot read"),
    "cut in the tensor table": (lambda b: b[: _tensor_at(b, "blk.1.ffn_up.weight")], "read"),
    "cut in the data": (lambda b: b[:-1000], "cannot load a causal LM"),
    "not GGUF": (lambda b: b"GGUX" + b[4:], "magic"),
    "version 9": (lambda b: _patched(b, 4, "<I", 9), "v9"),
    "2^60 tensors": (lambda b: _patched(b, 8, "<Q", 2**60), "cannot read"),
    "2^60 metadata keys": (lambda b: _patched(b, 16, "<Q", 2**60), "cannot read"),
    "value type 99": (
        lambda b: _patched(b, _value_at(b, "llama.context_length"), "<I", 99),
        "type 99",
    ),
    "an array of 2^32 + 1 tokens": (
        lambda b: _patched(b, _value_at(b, "tokenizer.ggml.tokens") + 8, "<Q", 2**32 + 1),
        "cannot read",
    ),
    "2^32 - 1 dimensions": (
        lambda b: _patched(b, _tensor_at(b, "token_embd.weight"), "<I", 2**32 - 1),
        "cannot read",
    ),
    "a dimension of 2^32": (
        lambda b: _patched(b, _tensor_at(b, "token_embd.weight") + 4, "<Q", 2**32),
        "cannot load a causal LM",
    ),
    "a tensor past the end": (
        lambda b: _patched(b, _tensor_at(b, "token_embd.weight") + 24, "<Q", 2**40),
        "cannot load a causal LM",
    ),
    "head_count 0": (
        lambda b: _patched(b, _value_at(b, "llama.attention.head_count") + 4, "<I", 0),
        "llama.attention.head_count=0: not a size",
    ),
    "embedding_length 0": (
        lambda b: _patched(b, _value_at(b, "llama.embedding_length") + 4, "<I", 0),
        "llama.embedding_length=0: not a size",
    ),
    "block_count 400": (
        lambda b: _patched(b, _value_at(b, "llama.block_count") + 4, "<I", 400),
        "llama.block_count=400: its tensor table holds 2 blocks (blk.0 to blk.1)",
    ),
    "block_count 1": (
        lambda b: _patched(b, _value_at(b, "llama.block_count") + 4, "<I", 1),
        "llama.block_count=1: its tensor table holds 2 blocks",
    ),
    "a weight missing": (
        lambda b: b.replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_xx.weight"),
        "1 weight (model.layers.1.mlp.up_proj.weight) missing from it would start at random",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_gguf_is_one_line_from_the_cli(good_gguf, tmp_path, capsys, case):
    """``rlpost export`` of each malformed file (it loads the model and its tokenizer):
    exit 2 and one line naming the problem, never a traceback, nothing written."""
    from rlpost.cli import main

    make, says = MALFORMED[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make(good_gguf))
    assert main(["export", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    # transformers' GGUF reader draws its own progress bar (\r-separated), rlpost may warn
    noise = ("rlpost: warning", "Converting and de-quantizing")
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(noise)]
    assert len(lines) == 1 and lines[0].startswith("rlpost: error: "), err
    assert says in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
