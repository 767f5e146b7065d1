"""Write a policy out: an HF directory, and a GGUF file llama.cpp-family runtimes load.

The GGUF is what llama.cpp's converter writes for a Llama model (the ``gguf`` package's
writer): ``llama.*`` metadata, the tokenizer as ``gpt2`` byte-level BPE, Q and K permuted to
llama.cpp's interleaved RoPE, norms in F32 and a matrix whose rows are not a multiple of 32
in F16 under Q8_0. The tiny model's BPE has no merges, which llama.cpp refuses; the export
says so on stderr.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from rlpost.errors import ModelLoadError

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")

# tokenizer.json pre-tokenizers llama.cpp implements, by the name it knows them under
PRE_TOKENIZERS = {
    "gpt-2": [{"type": "ByteLevel", "use_regex": True}],
    "smollm": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "use_regex": True},
    ],
}


def export_model(model, tokenizer, out: Path, *, gguf_type: str | None, overwrite: bool) -> dict:
    """Write ``out`` (an HF directory) and, with ``gguf_type``, ``out/gguf/model-<type>.gguf``,
    renamed into place; returns what was written."""
    if out.exists() and not overwrite:
        raise ModelLoadError(f"--out {str(out)!r} exists; choose another or pass --overwrite")
    if gguf_type is not None:
        check_llama(model.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        written = {"hf_dir": out}
        if gguf_type is not None:
            # its own folder: transformers reads a tokenizer_config.json beside a .gguf
            name = f"gguf/model-{gguf_type}.gguf"
            (tmp / "gguf").mkdir()
            write_gguf(model, tokenizer, tmp / name, gguf_type)
            written["gguf"] = out / name
        if out.exists() and overwrite:
            shutil.rmtree(out)
        tmp.rename(out)  # refused when another writer got there first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def check_llama(config) -> None:
    """A one-line refusal for a model llama.cpp's ``llama`` architecture cannot run."""
    problems = []
    if config.model_type != "llama":
        problems.append(f"model_type {config.model_type!r}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"RoPE scaling {rope.get('rope_type')!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("bias terms")
    if problems:
        raise ModelLoadError(
            f"--gguf writes Llama-architecture models without biases or RoPE scaling; this one "
            f"has {', '.join(problems)}; export without --gguf"
        )


def write_gguf(model, tokenizer, path: Path, gguf_type: str) -> None:
    """``model`` (a Llama causal LM) and ``tokenizer`` as one GGUF file at ``path``."""
    import gguf

    check_llama(model.config)
    writer = gguf.GGUFWriter(str(path), "llama")
    write_config(writer, model.config, gguf_type)
    write_tokenizer(writer, tokenizer, model.config.vocab_size)
    write_tensors(writer, model, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_config(writer, c, gguf_type: str) -> None:
    import gguf

    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    writer.add_name(Path(c.name_or_path).name or "rlpost-policy")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != c.hidden_size // c.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(file_types[gguf_type])
    if gguf_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def permute_for_llama_cpp(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``[n_head * head_dim, hidden]`` from HF's RoPE layout (each head's first half of
    dimensions rotates with its second half) to llama.cpp's (pairs side by side)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tensors(writer, model, gguf_type: str) -> None:
    import gguf

    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    tied = c.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the embedding when there is no output.weight
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ModelLoadError(f"--gguf: no llama.cpp tensor name for {hf_name!r}")
        w = tensor.detach().float().cpu()
        if hf_name.endswith("q_proj.weight"):
            w = permute_for_llama_cpp(w, c.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = permute_for_llama_cpp(w, c.num_key_value_heads)
        data, qtype = encode(w.numpy(), gguf_type)
        writer.add_tensor(name, data, raw_dtype=qtype)


def encode(data: np.ndarray, gguf_type: str):
    """(array to write, its ggml type) for one tensor."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if data.ndim == 1 or gguf_type == "f32":
        return data.astype(np.float32), T.F32
    if gguf_type == "q8_0" and data.shape[-1] % quants.GGML_QUANT_SIZES[T.Q8_0][0] == 0:
        return quants.quantize(data, T.Q8_0), T.Q8_0
    if gguf_type == "bf16":
        return quants.quantize(data, T.BF16), T.BF16
    return data.astype(np.float16), T.F16


def write_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's ``gpt2`` (byte-level BPE) vocabulary."""
    tokens, merges, pre = byte_level_vocab(tokenizer)
    added = tokenizer.added_tokens_decoder
    # a vocabulary token past the embedding means tokenizer and model do not belong together
    beyond = [i for i in range(vocab_size, len(tokens)) if tokens[i] is not None]
    if any(i not in added for i in beyond):
        raise ModelLoadError(
            f"--gguf: the tokenizer has {len(tokens)} tokens, the model's embedding {vocab_size}"
        )
    types, texts = [], []
    for i in range(vocab_size):
        if i >= len(tokens) or tokens[i] is None:
            texts.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
            continue
        texts.append(tokens[i])
        if i in added:
            types.append(3 if added[i].special else 4)  # CONTROL, USER_DEFINED
        else:
            types.append(1)  # NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(texts)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    else:
        # transformers rebuilds merges from scores; a one-character vocabulary yields none
        writer.add_token_scores([0.0] * vocab_size)
        print(
            "rlpost: warning: a vocabulary without merges: transformers and rlpost read this "
            "GGUF, llama.cpp refuses it (it needs a merges list)",
            file=sys.stderr,
        )
    write_special_tokens(writer, tokenizer)


def write_special_tokens(writer, tokenizer) -> None:
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    probe = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id
    writer.add_add_bos_token(bool(probe) and bos is not None and probe[0] == bos)
    writer.add_add_eos_token(False)
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)


def byte_level_vocab(tokenizer) -> tuple[list[str | None], list[str], str]:
    """(token text by id in the byte alphabet, merges as "a b", llama.cpp pre-tokenizer name)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    kind = spec["model"]["type"]
    by_id: list[str | None] = [None] * len(tokenizer)
    for text, i in tokenizer.get_vocab().items():
        if i < len(by_id):
            by_id[i] = text
    if kind == "WordLevel":
        return char_vocab(tokenizer, by_id), [], "gpt-2"
    if kind != "BPE":
        raise ModelLoadError(
            f"--gguf writes byte-level BPE tokenizers; this one is {kind}; export without --gguf"
        )
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return by_id, merges, pre


def pre_tokenizer_name(pre: dict | None) -> str:
    """The llama.cpp name of a tokenizer.json pre-tokenizer, or a one-line refusal."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    for name, want in PRE_TOKENIZERS.items():
        if len(want) == len(steps) and all(
            all(step.get(k) == v for k, v in w.items()) for step, w in zip(steps, want, strict=True)
        ):
            return name
    raise ModelLoadError(
        f"--gguf: the tokenizer's pre-tokenizer ({[s.get('type') for s in steps]}) has no "
        f"llama.cpp name rlpost knows ({', '.join(PRE_TOKENIZERS)}); export without --gguf"
    )


def char_vocab(tokenizer, by_id: list[str | None]) -> list[str | None]:
    """A one-character-per-token vocabulary respelled in the byte alphabet (special tokens
    stay as they are); refused when a token is neither special nor one ASCII character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    special = set(tokenizer.all_special_tokens)
    out: list[str | None] = []
    for text in by_id:
        if text is None or text in special:
            out.append(text)
        elif len(text) == 1 and ord(text) < 128:
            out.append(spelling[ord(text)])
        else:
            raise ModelLoadError(
                f"--gguf: the word-level token {text!r} is not one ASCII character; only "
                "character vocabularies are written as byte-level BPE"
            )
    return out
