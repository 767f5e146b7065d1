"""The part of ``rollout.engine=vllm`` and ``server=vllm`` that runs inside vLLM's workers.

vLLM mixes :class:`WeightLoader` into each worker (``worker_extension_cls``), so
``collective_rpc("rlpost_load_weights", ...)`` calls it by name: no pickled function crosses and
vLLM's insecure serialisation stays off. Arguments travel as msgpack, so tensors travel as a
safetensors file, loaded without unpickling through vLLM's in-place reload.

``/collective_rpc`` has no key, so a push is signed (HMAC-SHA256 of source and version,
:func:`sign`, key ``RLPOST_WEIGHTS_KEY``); a served loader (``RLPOST_WEIGHTS_FROM`` set) fetches
only ``http://`` URLs on that address, an in-process one only files; the file's header must name
tensors of the served checkpoint, of its shapes, in a float dtype, before any data is read.
Importing this module must stay cheap (no vLLM): the workers import it at start-up."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes

PULL_TIMEOUT_S = 300.0
KEY_ENV, FROM_ENV = "RLPOST_WEIGHTS_KEY", "RLPOST_WEIGHTS_FROM"
FLOAT_BYTES = {"F32": 4, "BF16": 2, "F16": 2}  # the trainer's dtypes; F32 the widest
HEADER_BYTES_PER_TENSOR = 512  # one entry's JSON: its name, dtype, shape and offsets


class WeightsRefused(ValueError):
    """A push the loader will not load, in one line."""


def sign(key: str, source: str, version: int | str) -> str:
    """The push's token: HMAC-SHA256 of ``source`` and ``version`` under ``key`` (hex)."""
    message = f"{source}\n{int(version)}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


class WeightLoader:
    """Worker extension: load a weight file into this worker's model, with a version."""

    def rlpost_load_weights(self, source: str, version: int | str, token: str = "") -> list:
        """Copy the tensors of the safetensors file at ``source`` (the trainer's URL, or a file for
        an in-process engine) into the model; returns ``[version, tensors loaded]`` so the caller
        can check every worker took it. ``version`` may be a string (``/collective_rpc`` passes
        only strings, and returns a list as JSON unchanged). A refused push answers ``["refused",
        why]``: raised, vLLM's route would answer a bare 500."""
        try:
            check_source(source, version, token, os.environ)
            if getattr(self, "_rlpost_tensors", None) is None:
                self._rlpost_tensors = checkpoint_tensors(self.vllm_config.model_config.model)
            weights = read_weights(source, self._rlpost_tensors)
        except (WeightsRefused, OSError) as exc:  # OSError: the URL did not answer
            why = exc if isinstance(exc, WeightsRefused) else f"weights refused: {exc!r}"
            return ["refused", str(why)]
        dtype = next(self.model_runner.get_model().parameters()).dtype
        # The trainer's dtype (fp32 master weights) becomes the serving dtype here.
        weights = [(name, t.to(dtype)) for name, t in weights]
        # vLLM's in-place reload, not the model's bare load_weights: backends that repack
        # weights after loading (the CPU one does) leave the checkpoint-format parameters
        # empty; the reload restores them, loads, and repacks into the same kernel tensors.
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        _reprocess_tied(self.model_runner.get_model())
        return [int(version), len(weights)]

    def rlpost_serves_seeds(self) -> list[bool]:
        """Whether this build takes per-request seeds: vLLM's CPU build cannot rewind a seeded
        request's generator after a chunked prefill ("CPU Generator does not use offset", vLLM
        0.32), an error that kills its engine core."""
        from vllm.platforms import current_platform

        return [not current_platform.is_cpu()]


def check_source(source: str, version: int | str, token: str, env) -> None:
    """Refuse (:class:`WeightsRefused`) a push not signed with ``env``'s key, or from a place this
    loader does not read: another address than ``RLPOST_WEIGHTS_FROM``, or a file when that is set
    (served), a URL when not (in process)."""
    key, origin, url = env.get(KEY_ENV), env.get(FROM_ENV), urlsplit(source)
    if not key:
        raise _refused(f"{KEY_ENV} is not set where vLLM runs; set it to the trainer's admin key")
    if not hmac.compare_digest(sign(key, source, version), str(token)):
        raise _refused(f"the push's token does not match {KEY_ENV}")
    if not origin and url.scheme:
        raise _refused(f"{source!r} is a URL and {FROM_ENV} (the trainer's address) is unset")
    if origin and (url.scheme != "http" or url.hostname != origin.strip("[]")):
        raise _refused(f"{source!r} is not on the trainer's address ({FROM_ENV}={origin})")


def checkpoint_tensors(model: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the served checkpoint (its safetensors headers): a
    directory, or a hub id vLLM has downloaded."""
    root = Path(model)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(model, allow_patterns="*.safetensors", local_files_only=True))
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    if not tensors:
        raise _refused(f"no safetensors checkpoint in {root} to check pushes against")
    return tensors


def read_weights(source: str, tensors: dict[str, tuple[int, ...]]) -> list:
    """The ``(name, tensor)`` pairs of the safetensors file at ``source`` (an ``http://`` URL or a
    path), its header checked against ``tensors`` (:func:`check_header`) and its body read no
    further than the header says."""
    url = urlsplit(source).scheme
    with urllib.request.urlopen(source, timeout=PULL_TIMEOUT_S) if url else open(source, "rb") as f:
        prefix = _read(f, 8)
        (length,) = struct.unpack("<Q", prefix)
        if length > HEADER_BYTES_PER_TENSOR * len(tensors):
            raise _refused(f"a {length}-byte header, more than {len(tensors)} tensors take")
        header = _read(f, length)
        body = _read(f, check_header(header, tensors))
        if f.read(1):
            raise _refused("the file runs past the tensors its header lists")
    try:
        return list(load_bytes(prefix + header + body).items())
    except SafetensorError as exc:  # what the checks above leave to safetensors (overlaps)
        raise _refused(f"not a safetensors file ({exc})") from None


def check_header(header: bytes, tensors: dict[str, tuple[int, ...]]) -> int:
    """The data length a safetensors ``header`` declares, once every entry names a tensor of
    ``tensors`` with its shape, a float dtype and the bytes those take; else refused."""
    try:
        entries = json.loads(header)
        entries.pop("__metadata__", None)
        rows = [(n, list(e["shape"]), e["dtype"], *e["data_offsets"]) for n, e in entries.items()]
        if any(len(row) != 5 or not all(isinstance(x, int) for x in row[3:]) for row in rows):
            raise ValueError("data_offsets are not two integers")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise _refused(f"not a safetensors header ({exc})") from None
    for name, shape, dtype, begin, stop in rows:
        if name not in tensors:
            raise _refused(f"{name!r} is not a tensor of the model")
        if shape != list(tensors[name]) or dtype not in FLOAT_BYTES:
            want = list(tensors[name])
            raise _refused(f"{name} is {dtype}{shape}, the model's is {want} in F32, BF16 or F16")
        if begin < 0 or stop - begin != math.prod(shape) * FLOAT_BYTES[dtype]:
            raise _refused(f"{name}'s offsets do not fit its shape")
    end = max((row[4] for row in rows), default=0)
    cap = sum(math.prod(s) for s in tensors.values()) * max(FLOAT_BYTES.values())
    if end > cap:
        raise _refused(f"{end} bytes of tensors, the model's take {cap}")
    return end


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise _refused(f"the file ends {n - len(data)} bytes early")
    return data


def _refused(why: str) -> WeightsRefused:
    return WeightsRefused(f"weights refused: {why}")


def _reprocess_tied(model) -> None:
    """Run the post-load processing again on every layer whose weight another layer shares: the
    reload processes a tied weight once (for the input embedding), and a head tied to it would keep
    what its processing built from the old weight (on CPU a packed GEMM operand)."""
    holders: dict[int, list] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            holders.setdefault(id(weight), []).append(module)
    for modules in holders.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
