"""Data-parallel training: N trainer workers share each update's batch, sharded with FSDP2.

Every rank receives the whole :class:`TrainBatch` and takes the contiguous ``rank``-th share
of each mini-batch. The update equals one worker's: loss denominators are counted on the whole
mini-batch, and the gradient divide factor is 1, so the reduce-scatter sums the shares.
All ranks must run as many passes, so a short share is padded with :data:`PAD` rows whose
``response_mask`` is zero.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlpost.models.loading import checkpointing, checkpointing_on

PAD = -1
"""Row index of a padding row in a rank's share (the row is a copy with its mask zeroed)."""


@dataclass(frozen=True)
class DPSpec:
    """Where one trainer worker sits in its data-parallel group."""

    rank: int
    world: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"DPSpec: rank {self.rank} is not in 0..{self.world - 1}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"DPSpec.backend={self.backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(spec: DPSpec, timeout_s: float = 600.0) -> None:
    """Join the process group of ``spec`` (blocks until all ``world`` ranks have joined)."""
    from datetime import timedelta

    from rlpost.sync.listen import pin_interface, tcp_store

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already set up in this process")
    timeout = timedelta(seconds=timeout_s)
    # the store on master_addr only (tcp:// would bind every address), sockets on its interface
    store = tcp_store(spec.master_addr, spec.master_port, spec.world, spec.rank == 0, timeout)
    pin_interface(
        spec.master_addr, "NCCL_SOCKET_IFNAME" if spec.backend == "nccl" else "GLOO_SOCKET_IFNAME"
    )
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world, timeout=timeout
    )


def destroy_group() -> None:
    """Leave the process group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(
    model: nn.Module, *, bf16: bool = False, trainable: bool = True, mesh=None, synced=False
) -> nn.Module:
    """Wrap ``model`` in FSDP2 in place: each decoder layer is a unit, the root the rest.

    Rank 0's weights are broadcast first unless ``synced``. ``mesh``: the data-parallel axis
    of a device mesh whose other axes already split the model (None: every rank). ``bf16``:
    gathered in bfloat16, gradients reduced and master weights kept in float32."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if not (synced or isinstance(t, DTensor)):  # a split one was, before its split
                dist.broadcast(t.data, src=0)
    non_reentrant_checkpointing(model)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        if next(layer.parameters(), None) is not None:  # not another stage's place
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if trainable:
        # shares of one global loss: sum, do not average (gloo has no PREMUL_SUM)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    return model


def non_reentrant_checkpointing(model: nn.Module) -> None:
    """Gradient checkpointing set on an HF model switched to the non-reentrant form, the
    one that composes with FSDP2's hooks and DTensor parameters."""
    if checkpointing_on(model):
        checkpointing(model, enable=False)
        checkpointing(model, reentrant=False)


def layers_name(model: nn.Module) -> str | None:
    """The name of an HF model's repeated transformer blocks (``model.layers``), or None."""
    lists = (n for n, m in model.named_modules() if isinstance(m, nn.ModuleList))
    return next((n for n in lists if n.endswith("layers")), None)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF model, the usual FSDP units."""
    return [] if (name := layers_name(model)) is None else list(model.get_submodule(name))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (a collective: every rank calls it), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def held_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds: its shards of sharded (DTensor) parameters.
    (Between a forward and the next reshard FSDP2's root lists its gathered copies.)"""
    return sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())


def resharded(model: nn.Module) -> nn.Module:
    """``model`` with its sharded parameters registered again: after a forward pass the
    root unit keeps its gathered copies registered, which are not the trained tensors."""
    if hasattr(model, "reshard"):
        model.reshard()
    return model


class DataParallel:
    """This rank's view of its group: which rows it takes, and the sums and gathers over the
    data-parallel axis of ``mesh`` (None: every rank)."""

    def __init__(self, spec: DPSpec, device: torch.device | None = None, mesh=None) -> None:
        self.spec = spec
        self.mesh = mesh
        self.rank, self.world = spec.rank, spec.world
        self.group = None  # the default group: every rank
        if mesh is not None:
            dp = mesh["dp"]
            self.rank, self.world, self.group = dp.get_local_rank(), dp.size(), dp.get_group()
        # named explicitly: the current CUDA device is per thread
        self.device = device if device is not None else torch.device("cpu")

    def share(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of ``rows``, padded with :data:`PAD` to
        ``ceil(len(rows) / world)`` entries (the same length on every rank)."""
        per = math.ceil(len(rows) / self.world)
        mine = rows[self.rank * per : (self.rank + 1) * per]
        pad = torch.full((per - len(mine),), PAD, dtype=rows.dtype)
        return torch.cat([mine, pad])

    def micro_slices(self, rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
        """This rank's share of mini-batch ``rows`` in micro-batches: the same count on
        every rank (a short share ends in padding rows)."""
        mine = self.share(rows)
        return [mine[lo : lo + micro_batch_size] for lo in range(0, len(mine), micro_batch_size)]

    @staticmethod
    def select(batch, rows: torch.Tensor):
        """``batch.select(rows)`` where :data:`PAD` rows are copies of row 0 with a zero
        ``response_mask`` (they weigh nothing in any masked loss or count)."""
        pad = rows == PAD
        micro = batch.select(rows.clamp(min=0))
        if pad.any():
            micro.response_mask = micro.response_mask.clone()
            micro.response_mask[pad] = 0
        return micro

    def map_rows(self, batch, fn: Callable) -> torch.Tensor:
        """``fn(sub_batch) -> [b, ...]`` on this rank's share of ``batch``, gathered into the
        ``[B, ...]`` result of ``fn(batch)`` on every rank (a scoring pass)."""
        rows = self.share(torch.arange(len(batch)))
        local = fn(self.select(batch, rows)).contiguous()
        return self.gather_rows(local, rows, len(batch))

    def gather_rows(self, local: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Put every rank's ``local [len(rows), ...]`` at its ``rows`` of an ``[n, ...]``
        tensor, on every rank (padding rows dropped)."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        rows = rows.to(local.device)  # nccl gathers device tensors only
        all_rows = [torch.empty_like(rows) for _ in range(self.world)]
        dist.all_gather(all_rows, rows.contiguous(), group=self.group)
        out = local.new_zeros((n, *local.shape[1:]))
        for part, idx in zip(parts, all_rows, strict=True):
            keep = idx != PAD
            out[idx[keep]] = part[keep]
        return out

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks; a key a rank lacks counts 0 there."""
        names: list[list[str]] = [[] for _ in range(self.world)]
        with self._on_device():  # nccl moves the objects through the current device
            dist.all_gather_object(names, sorted(values), group=self.group)
        keys = sorted(set().union(*names))
        t = torch.tensor(
            [values.get(k, 0.0) for k in keys], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(t, group=self.group)
        return dict(zip(keys, t.tolist(), strict=True))

    def _on_device(self):
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place; returned."""
        dist.all_reduce(t, group=self.group)
        return t

    def barrier(self) -> None:
        dist.barrier()


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """An ``optimizer.state_dict()`` keyed by parameter name, ``names[i]`` the ``i``-th's."""
    groups = state["param_groups"]
    if all(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }


def optimizer_state_by_index(state: dict, names: list[str]) -> dict:
    """The inverse of :func:`optimizer_state_by_name`: the form ``optimizer.load_state_dict``
    of one worker takes. A state already keyed by index is returned as is."""
    groups = state["param_groups"]
    if not any(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }
