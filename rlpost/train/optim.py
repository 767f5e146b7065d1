"""One optimizer step, written once: the actor, the critic and DPO all use it.

Zero, accumulate every micro-batch's gradient, clip, and step, unless the loss or norm is not
finite. :func:`minibatch_updates` is the PPO-style loop around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from rlpost.observe.threads import pace

M = TypeVar("M")


SLICE_BYTES = 8 * 2**20
"""Bytes of a parameter that :class:`SlicedAdamW` updates at a time."""


class SlicedAdamW(torch.optim.AdamW):
    """torch's AdamW, with a large parameter's update run on slices of :data:`SLICE_BYTES`.

    torch's CPU AdamW makes two parameter-sized temporaries at the peak of a step; on slices
    they are a slice's size. Weights, moments and state are bit-identical to
    ``torch.optim.AdamW``'s."""

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps):
        has_complex = super()._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps
        )
        if has_complex:
            return has_complex
        lists = [params, grads, exp_avgs, exp_avg_sqs] + ([max_sqs] if group["amsgrad"] else [])
        entries = list(zip(*lists, steps, strict=True))
        for x in (*lists, steps):
            x.clear()
        for *tensors, step in entries:
            size = max(64, SLICE_BYTES // tensors[0].element_size() // 64 * 64)
            n = tensors[0].numel()
            sharded = hasattr(tensors[0], "device_mesh")  # a DTensor's temporaries: a shard's
            if n <= size or sharded or not all(t.is_contiguous() for t in tensors):
                for x, t in zip(lists, tensors, strict=True):
                    x.append(t)
                steps.append(step)
                continue
            for lo in range(0, n, size):
                for x, t in zip(lists, tensors, strict=True):
                    x.append(t.view(-1)[lo : lo + size])
                # the others step a copy of the first's ``step``: every slice sees one count
                steps.append(step if lo == 0 else step.clone())
        return has_complex


@dataclass
class StepOutcome:
    """``loss``: the summed micro-batch losses; ``stats``: the summed micro-batch statistics
    (callers weight them); ``skipped``: the step was dropped as non-finite."""

    loss: float
    grad_norm: float
    skipped: bool
    stats: dict[str, float] = field(default_factory=dict)

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        out = dict(self.stats)
        out[f"{prefix}grad_norm"] = self.grad_norm
        out[f"{prefix}skipped"] = 1.0 if self.skipped else 0.0
        return out


def accumulate_grads(
    micro_batches: Iterable[M],
    micro_loss: Callable[[M], tuple[torch.Tensor, dict[str, float]]],
    order: list[tuple[str, int]] | None = None,
) -> tuple[float, dict[str, float]]:
    """(summed loss, summed statistics) over ``micro_batches``, gradients accumulated;
    ``order``: the passes as ``("F", i)`` and ``("B", i)`` (None: each backward after its
    forward)."""
    micros, pending = list(micro_batches), []
    loss_total, stats = 0.0, {}
    for op, i in order or [(op, i) for i in range(len(micros)) for op in "FB"]:
        if op == "B":
            pending.pop(0).backward()
            continue
        pace()  # the cores a co-located rollout process lends: observe.threads
        loss, micro_stats = micro_loss(micros[i])
        pending.append(loss)
        loss_total += float(loss.detach())
        for k, v in micro_stats.items():
            stats[k] = stats.get(k, 0.0) + v
    return loss_total, stats


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    micro_batches: Iterable[M],
    micro_loss: Callable[[M], tuple[torch.Tensor, dict[str, float]]],
    sum_ranks: Callable[[dict[str, float]], dict[str, float]] | None = None,
    accumulate=accumulate_grads,
) -> StepOutcome:
    """Accumulate ``micro_loss`` over ``micro_batches``, clip, and step (or skip when
    non-finite); ``sum_ranks`` sums the loss and statistics over data-parallel ranks."""
    optimizer.zero_grad(set_to_none=True)
    loss_total, stats = accumulate(micro_batches, micro_loss)
    if sum_ranks is not None:
        stats = sum_ranks({**stats, "\0loss": loss_total})
        loss_total = stats.pop("\0loss")
    return apply_grads(optimizer, scheduler, params, grad_clip, loss_total, stats)


def apply_grads(
    optimizer, scheduler, params, grad_clip: float, loss_total: float = 0.0, stats=None
) -> StepOutcome:
    """Clip the accumulated gradients of ``params`` and step (or skip when non-finite)."""
    grad_norm = float(clip_grad_norm(params, grad_clip))
    if not (math.isfinite(loss_total) and math.isfinite(grad_norm)):
        # A NaN / Inf loss or gradient never reaches the weights.
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(loss_total, grad_norm, True, stats or {})
    optimizer.step()
    scheduler.step()
    return StepOutcome(loss_total, grad_norm, False, stats or {})


def adamw(params: list[torch.nn.Parameter], optim) -> SlicedAdamW:
    """AdamW over ``params`` at ``optim``'s (a :class:`rlpost.config.OptimConfig`) peak LR,
    betas and weight decay; the caller's scheduler shapes the LR."""
    return SlicedAdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
    )


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` to a 2-norm of at most ``max_norm``; returns the norm
    before, a 0-d tensor alike on every rank. Each mesh's norm is taken apart, as one
    ``clip_grad_norm_`` cannot stack tensor-parallel meshes."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    staged = any(getattr(p, "pipeline_group", None) is not None for p in params)
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    if len(by_mesh) <= 1 and not staged:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if staged:
        total = _staged_norm(params)
    else:
        norms = []
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads)
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s
    for grads in by_mesh.values():
        for g in grads:
            g.mul_(coef)
    return total


def _staged_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The gradient norm over all pipeline stages: each tensor's norm, gathered in layer
    order, then their norm, so the total is one process's to the bit."""
    import torch.distributed as dist

    with_grad = [p for p in params if p.grad is not None]
    group = next(p.pipeline_group for p in with_grad if hasattr(p, "pipeline_group"))
    own = [hasattr(p, "pipeline_group") for p in with_grad]
    first, last = own.index(True), len(own) - own[::-1].index(True)
    norms = [torch.linalg.vector_norm(p.grad) for p in with_grad]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]  # FSDP2
    stages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, [n.cpu() for n in norms[first:last]], group=group)
    device = norms[0].device
    layers = [n.to(device) for stage in stages for n in stage]
    return torch.linalg.vector_norm(torch.stack(norms[:first] + layers + norms[last:]))


def minibatch_updates(
    num_rows: int,
    mini_batch_size: int,
    epochs: int,
    shuffle: torch.Generator,
    step: Callable[[torch.Tensor], dict[str, float]],
    groups: torch.Tensor | None = None,
) -> dict[str, float]:
    """``epochs`` passes of shuffled mini-batches (whole ``groups``), ``step(rows)`` on each;
    returns each statistic's mean and ``updates``, their count."""
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(epochs):
        order = shuffled_rows(num_rows, shuffle, groups)
        for lo in range(0, num_rows, mini_batch_size):
            for k, v in step(order[lo : lo + mini_batch_size]).items():
                sums[k] = sums.get(k, 0.0) + v
            updates += 1
    out = {k: v / max(updates, 1) for k, v in sums.items()}
    out["updates"] = float(updates)
    return out


def shuffled_rows(
    num_rows: int, shuffle: torch.Generator, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """A random order of ``num_rows`` rows; with ``groups``, a random order of the groups,
    each group's rows together and in their own order."""
    if groups is None:
        return torch.randperm(num_rows, generator=shuffle)
    ids, inverse = torch.unique(groups, return_inverse=True)
    place = torch.randperm(len(ids), generator=shuffle)[inverse]
    return torch.sort(place * num_rows + torch.arange(num_rows)).indices


def micro_slices(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """``rows`` cut into consecutive micro-batches."""
    return [rows[lo : lo + micro_batch_size] for lo in range(0, len(rows), micro_batch_size)]


def budget_slices(
    rows: torch.Tensor,
    prompt_lens: torch.Tensor,
    response_lens: torch.Tensor,
    micro_batch_size: int,
    max_tokens: int,
    *,
    packed: int = 0,
    groups: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """``rows`` cut into micro-batches of at most ``micro_batch_size`` rows whose padded size
    (``packed``: real tokens) stays within ``max_tokens``, longest first as verl's dynamic
    batch size; a row over the budget goes alone. ``max_tokens <= 0``: :func:`micro_slices`."""
    if max_tokens <= 0:
        return micro_slices(rows, micro_batch_size)
    length = {r: int(prompt_lens[r]) + int(response_lens[r]) for r in rows.tolist()}
    if groups is None:
        order = sorted(length, key=lambda r: -length[r])
    else:
        longest: dict[int, int] = {}
        for r, n in length.items():
            g = int(groups[r])
            longest[g] = max(longest.get(g, 0), n)
        order = sorted(length, key=lambda r: (-longest[int(groups[r])], int(groups[r]), -length[r]))
    out: list[list[int]] = []
    seen: set[int] = set()  # the groups whose prompt this micro-batch already counts
    widest_p = widest_r = total = 0
    for r in order:
        pr, tr = int(prompt_lens[r]), int(response_lens[r])
        p, t = max(widest_p, pr), max(widest_r, tr)
        shares = groups is not None and int(groups[r]) in seen
        real = (0 if shares else pr) + tr
        size = total + real if packed else (len(out[-1]) + 1 if out else 1) * (p + t)
        full = out and len(out[-1]) >= micro_batch_size
        if not out or full or size > max_tokens:
            out.append([])
            p, t, total, real = pr, tr, 0, pr + tr
            seen.clear()
        out[-1].append(r)
        if groups is not None:
            seen.add(int(groups[r]))
        widest_p, widest_r, total = p, t, total + real
    return [torch.tensor(m, dtype=rows.dtype) for m in out]
