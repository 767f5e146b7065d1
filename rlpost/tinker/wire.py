"""The Tinker wire format: the SDK's own protobuf messages read and written.

``forward_backward`` arrives as ``tinker.proto`` bytes (zstd when the client says so) and its
result, like a sample's, leaves as proto bytes: the SDK accepts nothing else for those two types.
Every other route is the SDK's pydantic types as JSON. Reading a request checks what a loss needs
(``target_tokens`` and the per-token inputs as long as the input, finite values) and raises
:class:`BadInput` naming the field, so a bad datum is a 400 before any model work."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

try:
    from tinker import types  # noqa: F401 (the pydantic types, for the service)
    from tinker.proto import tinker_public_pb2 as pb
except ImportError as exc:  # the service's one optional dependency
    raise ImportError(
        "the Tinker service needs the tinker SDK: pip install 'rlpost[tinker]'"
    ) from exc

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
# Inputs each built-in loss reads besides target_tokens (weights is cross_entropy's).
LOSS_INPUTS = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
}
OPTIONAL_INPUTS = {"weights", "mask", "sequence_ratio_mask"}


class BadInput(ValueError):
    """A request the service refuses: ``field=value: reason; fix`` (a 400)."""


@dataclass(frozen=True)
class Row:
    """One datum: ``tokens`` [N] in, ``inputs`` per position [N] (``target_tokens`` int64)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class FwdBwd:
    model_id: str
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    rows: list[Row]


def _tensor(name: str, t) -> np.ndarray:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise BadInput(f"loss_fn_inputs.{name}: dtype {t.dtype} is not float32 or int64")
    shape = list(t.shape)
    if t.HasField("sparse_csr"):
        if len(shape) != 2:
            raise BadInput(f"loss_fn_inputs.{name}: a sparse tensor must be 2-D, got {shape}")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
        values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
        for r in range(shape[0]):
            dense[r, cols[rows[r] : rows[r + 1]]] = values[rows[r] : rows[r + 1]]
        return dense
    arr = np.frombuffer(t.dense, dtype=dtype)
    if shape and math.prod(shape) != arr.size:
        raise BadInput(
            f"loss_fn_inputs.{name}: shape {shape} holds {math.prod(shape)} values, got {arr.size}"
        )
    return arr.reshape(shape) if shape else arr


def _row(i: int, d, loss_fn: str) -> Row:
    tokens: list[int] = []
    for chunk in d.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise BadInput(
                f"data[{i}].model_input: {chunk.WhichOneof('chunk')} chunks are not served; send token chunks"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if not tokens:
        raise BadInput(f"data[{i}].model_input: empty; a datum needs at least one token")
    inputs = {name: _tensor(f"{name} (data[{i}])", t) for name, t in d.loss_fn_inputs.items()}
    need = ("target_tokens",) + (LOSS_INPUTS.get(loss_fn, ()) if loss_fn != "cross_entropy" else ())
    for name in need:
        if name not in inputs:
            raise BadInput(
                f"data[{i}].loss_fn_inputs.{name}: missing; loss_fn={loss_fn} needs {', '.join(need)}"
            )
    allowed = set(need) | OPTIONAL_INPUTS
    for name, arr in inputs.items():
        if name not in allowed:
            raise BadInput(
                f"data[{i}].loss_fn_inputs.{name}: not an input of loss_fn={loss_fn} (takes {', '.join(sorted(allowed))})"
            )
        if arr.ndim != 1 or len(arr) != len(tokens):
            raise BadInput(
                f"data[{i}].loss_fn_inputs.{name}: shape {list(arr.shape)}, expected [{len(tokens)}] (the model_input's length)"
            )
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise BadInput(
                f"data[{i}].loss_fn_inputs.{name}: not finite at position {int(np.argmin(np.isfinite(arr)))}; send finite values"
            )
    inputs["target_tokens"] = inputs["target_tokens"].astype(np.int64)
    return Row(tokens, inputs)


def read_fwdbwd(body: bytes, encoding: str | None) -> FwdBwd:
    """Decode a ``/forward_backward`` body, checked as :class:`Row` says."""
    if encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError carries no field
        raise BadInput(
            f"body: not a ForwardBackwardRequest ({exc}); send it with the tinker SDK"
        ) from exc
    config = {
        k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"
    }
    config = config or dict(msg.loss_fn_config)
    if not msg.data:
        raise BadInput("data: empty; send at least one Datum")
    rows = [_row(i, d, msg.loss_fn) for i, d in enumerate(msg.data)]
    return FwdBwd(msg.model_id, msg.loss_fn, config, msg.forward_only, rows)


def _batched(arrays: list[np.ndarray], dtype) -> pb.BatchedTensor:
    sizes = [a.size * np.dtype(dtype).itemsize for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    data = b"".join(np.asarray(a, dtype=dtype).tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def fwdbwd_output(outputs: dict[str, list[np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput`` with one float32 field per name, a value per datum."""
    n = len(next(iter(outputs.values())))
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=n)
    for name, arrays in outputs.items():
        record.fields[name].CopyFrom(_batched(arrays, np.float32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def sample_output(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs=None
) -> bytes:
    """A ``SampleResponse``: ``(tokens, logprobs, "stop"|"length")`` per sequence; prompt
    logprobs NaN where there is none (position 0)."""
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        msg.sequences.add(
            stop_reason=reasons[reason],
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
