"""Padding-free passes: the rows of a micro-batch packed into one sequence.

A padded micro-batch is ``[b, P + T]`` wide, set by its longest prompt and longest
response; with responses of mixed lengths most of it can be padding, and every
layer (and the LM head, on the padded response columns) computes on it. Packed,
the real tokens of the ``b`` rows are laid end to end as ``input_ids [1, N]`` with
``N`` their total, and the position ids restart at 0 at each row, so each row sees
the positions it has alone (verl's remove-padding, slime's and TRL's packing).

Attention must not cross rows. transformers (5.x) reads the restarts itself: with
no 2-D attention mask and no cache, ``masking_utils`` turns ``position_ids`` into a
block-diagonal causal mask (sdpa, eager, flex attention), and the flash-attention
paths turn them into varlen ``cu_seqlens``. A model that does not (an architecture
with its own mask code, a recurrent layer) would let rows see each other, so
:func:`pack_reason` runs a probe once per model class: two rows packed against the
same rows alone. Where it fails the trainer pads, and says so in one line.

On CPU the sdpa mask is a dense ``[N, N]``: attention costs ``N^2`` instead of
``sum_i L_i^2``, small beside the MLP and the LM head at the token budgets of a
micro-batch, and the price of not computing on padding anywhere else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlpost.train.batch import TrainBatch

log = logging.getLogger(__name__)

PACKING_MODES = ("auto", "on", "off")

# Attention implementations whose masks transformers builds from packed position ids.
_PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of ``b`` rows end to end.

    input_ids, position_ids: ``[1, N]`` (positions restart at 0 at each row).
    at: ``[n]`` the positions in ``N`` whose output predicts a response token, in the
    order of ``where [b, T]`` (True at each real response token), row by row.
    targets: ``[n]`` those response tokens.
    """

    input_ids: Tensor
    position_ids: Tensor
    at: Tensor
    where: Tensor
    targets: Tensor

    def scatter(self, values: Tensor) -> Tensor:
        """``[n]`` values back at ``where``: ``[b, T]``, 0 elsewhere (differentiable)."""
        out = values.new_zeros(self.where.shape)
        return out.masked_scatter(self.where, values)


def pack_rows(batch: TrainBatch) -> PackedRows:
    """:class:`PackedRows` of ``batch`` (its layout: prompts left-, responses right-padded)."""
    keep = batch.attention_mask.bool()
    flat = keep.flatten().cumsum(0).view(keep.shape) - 1  # each kept token's place in N
    P, T = batch.prompt_width, batch.responses.shape[1]
    where = keep[:, P:]
    # The output at column c predicts the token at c + 1: columns P - 1 .. P + T - 2.
    at = flat[:, P - 1 : P + T - 1][where]
    return PackedRows(
        input_ids=batch.input_ids[keep][None],
        position_ids=batch.position_ids[keep][None],
        at=at,
        where=where,
        targets=batch.responses[where],
    )


def packed_forward(module: torch.nn.Module, packed: PackedRows, **extra):
    """``module`` (a causal LM or its decoder) on the packed sequence: no attention mask,
    so the position ids' restarts set the rows' boundaries."""
    return module(
        input_ids=packed.input_ids,
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


def resolve_packing(mode: str, model: torch.nn.Module, *, sharded: bool = False) -> bool:
    """Whether the trainer packs ``model``'s passes under ``train.packing=mode``.

    ``off``: never. ``on``/``auto``: where the model can (:func:`pack_reason`); where it
    cannot the trainer pads and one warning line says why."""
    if mode not in PACKING_MODES:
        raise ValueError(f"train.packing={mode}: unknown; use one of {', '.join(PACKING_MODES)}")
    if mode == "off":
        return False
    reason = "data-parallel ranks cut micro-batches by rows" if sharded else pack_reason(model)
    if reason is not None:
        log.warning("train.packing=%s: padding instead, %s", mode, reason)
        return False
    return True
