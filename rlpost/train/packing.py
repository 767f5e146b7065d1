"""Padding-free passes: the rows of a micro-batch packed into one sequence.

A padded micro-batch is ``[b, P + T]`` wide, set by its longest prompt and longest
response; with responses of mixed lengths most of it can be padding, and every
layer (and the LM head, on the padded response columns) computes on it. Packed,
the real tokens of the ``b`` rows are laid end to end, ``N`` tokens in all, in as
few sequences of :func:`line_tokens` as they fit, and the position ids restart at 0
at each row, so each row sees the positions it has alone (verl's remove-padding,
slime's and TRL's packing).

Attention must not cross rows. transformers (5.x) reads the restarts itself: with
no 2-D attention mask and no cache, ``masking_utils`` turns ``position_ids`` into a
block-diagonal causal mask (sdpa, eager, flex attention), and the flash-attention
paths turn them into varlen ``cu_seqlens``. A model that does not (an architecture
with its own mask code, a recurrent layer) would let rows see each other, so
:func:`pack_reason` runs a probe once per model class: two rows packed against the
same rows alone. Where it fails the trainer pads, and says so in one line.

The sdpa and eager masks are dense ``[W, W]`` per sequence: attention costs ``W^2``
instead of ``sum_i L_i^2``. :func:`line_tokens` sets ``W`` from the model's widths so
that this stays a small share of the layers' matmuls (a wider sequence saves nothing:
the rows' tokens are the same, only fewer sequences hold them).

Shared prompts (:attr:`Pack.SHARED`): the rows of a GRPO group have one prompt, and a
causal model's outputs over it are the same in every row. So the group runs as one
segment, its prompt once and then each row's response, the responses' positions going
on from the prompt's end, under a mask that lets each response see the prompt and
itself, never a sibling (the shared-prefix forward of Prefix Grouper, arXiv 2506.05433).
The numbers are the rows' own within float rounding; the gradient reaching the prompt
is the sum over its rows, as autograd gives it through the copies. A group of G rows
with prompts of p tokens and responses of r costs p + G r tokens instead of G (p + r).
The masks are custom, so transformers is handed them as they are (a bool ``[k, 1, W, W]``
for sdpa, an additive one for eager); other attentions take the rows packed alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PACKING_MODES = ("auto", "shared", "on", "off")
SHARING_MODES = ("auto", "shared")
"""The modes whose mini-batches shuffle whole groups (:func:`rlpost.train.optim.shuffled_rows`),
so that a group's prompt can run once. The shuffle follows the mode, not what the model
allows, so every layout of a run (data-parallel ranks pad) draws the same mini-batches."""

# Attention implementations whose masks transformers builds from packed position ids.
_PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# ... and those that read a custom 4-D mask as it is given (shared prompts).
_MASKED_ATTENTION = ("sdpa", "eager")


class Pack(IntEnum):
    """How a trainer pass lays its rows out (false only for the padded layout)."""

    PADDED = 0
    ROWS = 1  # the rows end to end
    SHARED = 2  # ... and the rows with one prompt after a single copy of it

    def groups(self, batch: Any) -> Tensor | None:
        """``batch.group`` when rows share prompts, for the shuffles and token budgets to
        keep each group's rows together (:mod:`rlpost.train.optim`); else None."""
        return batch.group if self is Pack.SHARED else None


LINE_TOKENS = 2048
"""The most tokens a packed sequence holds (a longer row is a sequence of its own). It
bounds the dense ``[W, W]`` attention mask."""

ATTENTION_SHARE = 0.05
"""What the dense mask's wasted attention may cost beside a layer's matmuls: a sequence of
``W`` tokens computes ``W`` keys for every query, about ``4 H W`` FLOPs a token against the
layer's ``2 (4 H^2 + 3 H I)``, so :func:`line_tokens` keeps ``W`` near this share of that."""


def line_tokens(model: torch.nn.Module) -> int:
    """The width of ``model``'s packed sequences: the longest one whose dense attention
    stays within :data:`ATTENTION_SHARE` of a layer's matmuls (a 512-wide model: ~170
    tokens; 4096-wide with 11008 in the MLP: ~1,200), at most :data:`LINE_TOKENS`. A
    longer row is a sequence of its own, so the rows cost what they would alone, padding
    aside."""
    cfg = getattr(_base(model), "config", None)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    inner = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    if hidden <= 0:
        return LINE_TOKENS
    per_token = 2 * (4 * hidden * hidden + 3 * hidden * inner)
    return max(1, min(LINE_TOKENS, round(ATTENTION_SHARE * per_token / (4 * hidden))))


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of ``b`` rows end to end in ``k`` sequences of width ``W``.

    input_ids, position_ids: ``[k, W]`` (positions restart at 0 at each row; a sequence's
    unused tail is a segment of its own, after every row, so no row sees it).
    at: ``[n]`` the places in the flattened ``[k * W]`` whose output predicts a response
    token, in the order of ``where [b, T]`` (True at each real response token), row by row.
    targets: ``[n]`` those response tokens."""

    input_ids: Tensor
    position_ids: Tensor
    at: Tensor
    where: Tensor
    targets: Tensor
    mask: Tensor | None = None
    """``[k, 1, W, W]`` bool, True where a query may attend a key, when rows share a
    prompt; None: the position ids' restarts set the boundaries."""

    def attention(self, module: torch.nn.Module) -> Tensor | None:
        """:attr:`mask` in the form ``module``'s attention reads: eager adds it to the
        scores, sdpa takes the bool (both pass a 4-D mask through as it is)."""
        if self.mask is None or _attn_implementation(module) != "eager":
            return self.mask
        dtype = next(module.parameters()).dtype
        zero = torch.zeros((), dtype=dtype, device=self.mask.device)
        return zero.masked_fill(~self.mask, torch.finfo(dtype).min)

    def gather(self, out: Tensor) -> Tensor:
        """The ``[k, W, ...]`` outputs at :attr:`at`: ``[n, ...]``."""
        return out.flatten(0, 1)[self.at]

    def scatter(self, values: Tensor) -> Tensor:
        """``[n]`` values back at ``where``: ``[b, T]``, 0 elsewhere."""
        return scatter(values, self.where)


def scatter(values: Tensor, where: Tensor) -> Tensor:
    """``[N]`` values at the True entries of ``where [B, T]``, 0 elsewhere (differentiable)."""
    return values.new_zeros(where.shape).masked_scatter(where, values)


def _ranges(starts: Tensor, lens: Tensor) -> tuple[Tensor, Tensor]:
    """Every index of the ranges ``[starts[i], starts[i] + lens[i])`` in order, and each
    one's offset within its range."""
    within = torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens).repeat_interleave(lens)
    return starts.repeat_interleave(lens) + within, within


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


def _places(units, lines, sizes, width, prompt_of, response_lens):
    """Where each unit starts in the flattened ``[k * width]``; per row, the place that
    predicts its first token, where its response starts, its slot in its unit (1 + its
    index) and its prompt's length; each line's used width. Plain ints (a tensor write
    per row is what cost); the tokens then move by one indexed copy per kind."""
    n = len(response_lens)
    unit_at, line_end = [0] * len(units), []
    first, rest, slot, prompt = [0] * n, [0] * n, [0] * n, [0] * n
    for j, line in enumerate(lines):
        offset = 0
        for u in line:
            unit_at[u] = j * width + offset
            base = unit_at[u] + prompt_of[u]
            for k, i in enumerate(units[u]):
                # row i's token 0 is predicted at the prompt's last place, its token t > 0
                # at the place of its own token t - 1
                first[i], rest[i] = unit_at[u] + prompt_of[u] - 1, base
                slot[i], prompt[i] = k + 1, prompt_of[u]
                base += response_lens[i]
            offset += sizes[u]
        line_end.append(offset)
    return unit_at, first, rest, slot, prompt, line_end


def pack_rows(batch: Any, line_tokens: int = 0, shared: bool = False) -> PackedRows:
    """:class:`PackedRows` of ``batch``, a :class:`rlpost.train.batch.TrainBatch` (not
    imported: that module imports this one; prompts left-, responses right-padded),
    in sequences of ``line_tokens`` (0: :data:`LINE_TOKENS`; a model's: :func:`line_tokens`).
    ``shared``: rows whose prompts are the same tokens run it once (the module's docstring)."""
    line_tokens = min(line_tokens, LINE_TOKENS) if line_tokens > 0 else LINE_TOKENS
    keep = batch.attention_mask.bool()
    P = batch.prompt_width
    prompt_lens = keep[:, :P].sum(-1).tolist()
    where = keep[:, P:]
    response_lens = where.sum(-1).tolist()
    units = _same_prompts(batch.input_ids[:, :P], prompt_lens) if shared else None
    units = units or [[i] for i in range(len(prompt_lens))]
    sizes = [prompt_lens[u[0]] + sum(response_lens[i] for i in u) for u in units]
    lines = _lines(sizes, line_tokens)
    width = max(sum(sizes[u] for u in line) for line in lines)
    prompt_of = [prompt_lens[u[0]] for u in units]  # a unit's prompt: its lead row's
    places = _places(units, lines, sizes, width, prompt_of, response_lens)
    unit_at, first, rest, slot, row_prompt, line_end = places
    n, cols = len(prompt_lens), batch.input_ids.shape[1]
    lens, k_lines = torch.tensor(response_lens), torch.arange(len(lines))
    source = batch.input_ids.flatten().cpu()
    ids = torch.zeros(len(lines) * width, dtype=source.dtype)
    pos = torch.zeros_like(ids)
    # which unit (a row, or rows sharing a prompt) and which part of it (0: the prompt,
    # 1 + j: its j-th row's response) each place holds; the tail of a line is a unit alone
    unit_of, part_of = (-1 - k_lines).repeat_interleave(width), torch.zeros_like(ids)
    starts, p_lens = torch.tensor(unit_at), torch.tensor(prompt_of)
    dst, k = _ranges(starts, p_lens)  # the prompts, from their lead rows
    lead = torch.tensor([u[0] for u in units])
    ids[dst], pos[dst] = source[_ranges(lead * cols + P - p_lens, p_lens)[0]], k
    sizes_t = torch.tensor(sizes)
    unit_of[_ranges(starts, sizes_t)[0]] = torch.arange(len(units)).repeat_interleave(sizes_t)
    dst, k = _ranges(torch.tensor(rest), lens)  # the responses
    ids[dst] = source[_ranges(torch.arange(n) * cols + P, lens)[0]]
    pos[dst] = k + torch.tensor(row_prompt).repeat_interleave(lens)
    part_of[dst] = torch.tensor(slot).repeat_interleave(lens)
    ends = torch.tensor(line_end)
    dst, k = _ranges(k_lines * width + ends, width - ends)  # each line's tail
    pos[dst] = k
    at, k = _ranges(torch.tensor(rest) - 1, lens)
    at[k == 0] = torch.tensor(first)[lens > 0]
    shape, device = (len(lines), width), batch.input_ids.device
    ids, pos, unit_of, part_of = (x.view(shape).to(device) for x in (ids, pos, unit_of, part_of))
    at = at.to(device)
    mask = None
    if any(len(u) > 1 for u in units):
        same = unit_of[:, :, None] == unit_of[:, None, :]
        sees = (part_of[:, None, :] == 0) | (part_of[:, None, :] == part_of[:, :, None])
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        mask = (same & sees & causal)[:, None]
    return PackedRows(ids, pos, at, where, batch.responses[where], mask)


def pack_for(batch: Any, module: torch.nn.Module, layout: Pack) -> PackedRows:
    """:func:`pack_rows` of ``batch`` as ``layout`` packs it, in ``module``'s sequence width
    (:func:`line_tokens`)."""
    return pack_rows(batch, line_tokens(module), shared=layout == Pack.SHARED)


def _same_prompts(prompts: Tensor, prompt_lens: list[int]) -> list[list[int]] | None:
    """Row ids grouped by identical real prompt tokens (left-padded ``prompts [b, P]``), in
    the order of each group's first row; None when no two rows share a prompt."""
    P = prompts.shape[1]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(prompts.tolist()):
        groups.setdefault(tuple(row[P - prompt_lens[i] :]), []).append(i)
    if len(groups) == len(prompt_lens):
        return None
    return list(groups.values())


def packed_forward(module: torch.nn.Module, packed: PackedRows, inputs_embeds=None, **extra):
    """``module`` (a causal LM or its decoder) on the packed sequences (or their
    ``inputs_embeds``): the shared prompts' mask, or none, so that the position ids'
    restarts set the rows' boundaries."""
    ids = {"input_ids": packed.input_ids} if inputs_embeds is None else {}
    return module(
        **ids,
        inputs_embeds=inputs_embeds,
        position_ids=packed.position_ids,
        attention_mask=packed.attention(module),
        use_cache=False,
        **extra,
    )


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pack_reason(model: torch.nn.Module, shared: bool = False) -> str | None:
    """None when ``model``'s passes may be packed (``shared``: with shared prompts), else
    why not (one phrase)."""
    base = _base(model)
    impl = _attn_implementation(base)
    if impl not in (_MASKED_ATTENTION if shared else _PACKED_ATTENTION):
        what = "a custom 4-D mask" if shared else "packed position ids"
        return f"attention implementation {impl!r} does not read {what}"
    key = (type(base), impl, shared)
    if key not in _PROBED:
        _PROBED[key] = _probe(base, shared)
    return _PROBED[key]


_PROBED: dict[tuple[type, str, bool], str | None] = {}


def _attn_implementation(module: torch.nn.Module) -> str | None:
    return getattr(getattr(_base(module), "config", None), "_attn_implementation", None)


@torch.no_grad()
def _probe(model: torch.nn.Module, shared: bool) -> str | None:
    """Three rows, two of one prompt, packed against each row alone: the outputs that
    predict the responses must agree."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    device = next(model.parameters()).device
    rows = [([1, 2, 3, 4], [5, 6, 7]), ([1, 2, 3, 4], [8, 9, 10]), ([11, 12], [13, 14, 15])]
    width = max(len(p) for p, _ in rows)  # a TrainBatch's layout: prompts left-padded

    def tensor(values):
        return torch.tensor(values, device=device) % vocab

    ids = tensor([[0] * (width - len(p)) + p + r for p, r in rows])
    probe = SimpleNamespace(
        input_ids=ids,
        attention_mask=tensor([[0] * (width - len(p)) + [1] * (len(p) + len(r)) for p, r in rows]),
        prompt_width=width,
        responses=ids[:, width:],
    )
    was_training = model.training
    model.eval()
    try:
        alone = []
        for p, r in rows:
            row = tensor(p + r)[None]
            out = decoder(
                input_ids=row, position_ids=torch.arange(row.shape[1])[None], use_cache=False
            ).last_hidden_state[0, len(p) - 1 : -1]
            alone.append(out.float())
        packed = pack_rows(probe, shared=shared)
        got = packed.gather(packed_forward(decoder, packed).last_hidden_state).float()
    except (TypeError, ValueError, RuntimeError) as e:
        return f"its forward refused a packed sequence ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    want = torch.cat(alone)
    low_precision = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    tol = (5e-2 if low_precision else 1e-3) * (1.0 + float(want.abs().max()))
    if float((got - want).abs().max()) > tol:
        return f"{type(model).__name__} lets packed rows attend to each other"
    return None


def resolve_packing(mode: str, model: torch.nn.Module, *, sharded: bool = False) -> Pack:
    """How the trainer lays out ``model``'s passes under ``train.packing=mode``.

    ``off``: padded. ``on``: rows packed where the model can (:func:`pack_reason`).
    ``shared`` and ``auto``: packed with shared prompts where the model's attention reads
    the mask, else as ``on``. Each step down says why in one warning line."""
    if mode not in PACKING_MODES:
        raise ValueError(f"train.packing={mode}: unknown; use one of {', '.join(PACKING_MODES)}")
    if mode == "off":
        return Pack.PADDED
    reason = "data-parallel ranks cut micro-batches by rows" if sharded else pack_reason(model)
    if reason is not None:
        log.warning("train.packing=%s: padding instead, %s", mode, reason)
        return Pack.PADDED
    if mode == "on":
        return Pack.ROWS
    reason = pack_reason(model, shared=True)
    if reason is not None:
        log.warning("train.packing=%s: rows packed, each with its own prompt, %s", mode, reason)
        return Pack.ROWS
    return Pack.SHARED
