"""Padding-free passes: the rows of a micro-batch packed into one sequence.

A padded micro-batch is ``[b, P + T]`` wide, set by its longest prompt and longest
response; with responses of mixed lengths most of it can be padding, and every
layer (and the LM head, on the padded response columns) computes on it. Packed,
the real tokens of the ``b`` rows are laid end to end, ``N`` tokens in all, in as
few sequences of :data:`LINE_TOKENS` as they fit, and the position ids restart at 0
at each row, so each row sees
the positions it has alone (verl's remove-padding, slime's and TRL's packing).

Attention must not cross rows. transformers (5.x) reads the restarts itself: with
no 2-D attention mask and no cache, ``masking_utils`` turns ``position_ids`` into a
block-diagonal causal mask (sdpa, eager, flex attention), and the flash-attention
paths turn them into varlen ``cu_seqlens``. A model that does not (an architecture
with its own mask code, a recurrent layer) would let rows see each other, so
:func:`pack_reason` runs a probe once per model class: two rows packed against the
same rows alone. Where it fails the trainer pads, and says so in one line.

The sdpa and eager masks are dense ``[W, W]`` per sequence: attention costs ``W^2``
instead of ``sum_i L_i^2``, which :data:`LINE_TOKENS` bounds; small beside the MLP and
the LM head, and the price of not computing on padding anywhere else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PACKING_MODES = ("auto", "on", "off")

# Attention implementations whose masks transformers builds from packed position ids.
_PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


LINE_TOKENS = 2048
"""Tokens per packed sequence: the rows go into as few sequences of this length as they fit
(a longer row is a sequence of its own). It bounds the dense ``[N, N]`` attention mask."""


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of ``b`` rows end to end in ``k`` sequences of width ``W``.

    input_ids, position_ids: ``[k, W]`` (positions restart at 0 at each row; a sequence's
    unused tail is a segment of its own, after every row, so no row sees it).
    at: ``[n]`` the places in the flattened ``[k * W]`` whose output predicts a response
    token, in the order of ``where [b, T]`` (True at each real response token), row by row.
    targets: ``[n]`` those response tokens.
    """

    input_ids: Tensor
    position_ids: Tensor
    at: Tensor
    where: Tensor
    targets: Tensor

    def gather(self, out: Tensor) -> Tensor:
        """The ``[k, W, ...]`` outputs at :attr:`at`: ``[n, ...]``."""
        return out.flatten(0, 1)[self.at]

    def scatter(self, values: Tensor) -> Tensor:
        """``[n]`` values back at ``where``: ``[b, T]``, 0 elsewhere (differentiable)."""
        out = values.new_zeros(self.where.shape)
        return out.masked_scatter(self.where, values)


def _lines(lengths: list[int], line_tokens: int) -> list[list[int]]:
    """Row ids in sequences of at most ``line_tokens`` tokens: first fit, longest first."""
    lines: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, free in enumerate(room) if lengths[i] <= free), len(lines))
        if j == len(lines):
            lines.append([])
            room.append(max(line_tokens, lengths[i]))
        lines[j].append(i)
        room[j] -= lengths[i]
    return lines


def pack_rows(batch: Any, line_tokens: int = 0) -> PackedRows:
    """:class:`PackedRows` of ``batch``, a :class:`rlpost.train.batch.TrainBatch` (not
    imported: that module imports this one; prompts left-, responses right-padded),
    in sequences of ``line_tokens`` (0: :data:`LINE_TOKENS`)."""
    line_tokens = line_tokens if line_tokens > 0 else LINE_TOKENS
    keep = batch.attention_mask.bool()
    P = batch.prompt_width
    lengths = keep.sum(-1).tolist()
    prompt_lens = keep[:, :P].sum(-1).tolist()
    where = keep[:, P:]
    lines = _lines(lengths, line_tokens)
    width = max(sum(lengths[i] for i in line) for line in lines)
    ids = batch.input_ids.new_zeros((len(lines), width))
    pos = torch.zeros_like(ids)
    start = [0] * len(lengths)
    for j, line in enumerate(lines):
        offset = 0
        for i in line:
            n = lengths[i]
            ids[j, offset : offset + n] = batch.input_ids[i][keep[i]]
            start[i] = j * width + offset
            offset += n
        pos[j] = _restarts([lengths[i] for i in line] + [width - offset], ids.device)
    # Row i's token c (of its real ones) sits at start + c, and the output there predicts
    # token c + 1: the response's at start + prompt - 1 + t.
    response_lens = where.sum(-1).tolist()
    at = torch.cat(
        [
            torch.arange(r, device=ids.device) + (start[i] + prompt_lens[i] - 1)
            for i, r in enumerate(response_lens)
        ]
    )
    return PackedRows(ids, pos, at, where, batch.responses[where])


def _restarts(lengths: list[int], device) -> Tensor:
    """Positions ``0 .. n - 1`` of each length, end to end."""
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def packed_forward(module: torch.nn.Module, packed: PackedRows, inputs_embeds=None, **extra):
    """``module`` (a causal LM or its decoder) on the packed sequences (or their
    ``inputs_embeds``): no attention mask, so the position ids' restarts set the rows'
    boundaries."""
    ids = {"input_ids": packed.input_ids} if inputs_embeds is None else {}
    return module(
        **ids,
        inputs_embeds=inputs_embeds,
        position_ids=packed.position_ids,
        attention_mask=None,
        use_cache=False,
        **extra,
    )


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pack_reason(model: torch.nn.Module) -> str | None:
    """None when ``model``'s passes may be packed, else why not (one phrase)."""
    base = _base(model)
    cfg = getattr(base, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in _PACKED_ATTENTION:
        return f"attention implementation {impl!r} does not read packed position ids"
    key = (type(base), impl)
    if key not in _PROBED:
        _PROBED[key] = _probe(base)
    return _PROBED[key]


_PROBED: dict[tuple[type, str], str | None] = {}


@torch.no_grad()
def _probe(model: torch.nn.Module) -> str | None:
    """Two rows packed against the same rows alone: the outputs must agree."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    device = next(model.parameters()).device
    rows = [torch.arange(1, 6, device=device) % vocab, torch.arange(7, 11, device=device) % vocab]
    was_training = model.training
    model.eval()
    try:
        alone = [
            decoder(input_ids=r[None], position_ids=torch.arange(len(r), device=device)[None],
                    use_cache=False).last_hidden_state[0].float()
            for r in rows
        ]  # fmt: skip
        ids = torch.cat(rows)[None]
        pos = torch.cat([torch.arange(len(r), device=device) for r in rows])[None]
        out = decoder(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False)
    except (TypeError, ValueError, RuntimeError) as e:
        return f"its forward refused a packed sequence ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    packed, want = out.last_hidden_state[0].float(), torch.cat(alone)
    low_precision = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    tol = (5e-2 if low_precision else 1e-3) * (1.0 + float(want.abs().max()))
    if float((packed - want).abs().max()) > tol:
        return f"{type(model).__name__} lets packed rows attend to each other"
    return None


AUTO_MIN_VOCAB = 32_768
"""``auto`` packs models with at least this vocabulary: real checkpoints (32k-152k), where
padding costs the most; the built-in character vocabulary keeps its exact padded numbers."""


def resolve_packing(mode: str, model: torch.nn.Module, *, sharded: bool = False) -> bool:
    """Whether the trainer packs ``model``'s passes under ``train.packing=mode``.

    ``off``: never. ``on``: where the model can (:func:`pack_reason`). ``auto``: as ``on``
    for a vocabulary of :data:`AUTO_MIN_VOCAB` or more, else never. Where the model cannot,
    the trainer pads and one warning line says why."""
    if mode not in PACKING_MODES:
        raise ValueError(f"train.packing={mode}: unknown; use one of {', '.join(PACKING_MODES)}")
    vocab = int(getattr(getattr(_base(model), "config", None), "vocab_size", 0) or 0)
    if mode == "off" or (mode == "auto" and vocab < AUTO_MIN_VOCAB):
        return False
    reason = "data-parallel ranks cut micro-batches by rows" if sharded else pack_reason(model)
    if reason is not None:
        log.warning("train.packing=%s: padding instead, %s", mode, reason)
        return False
    return True
