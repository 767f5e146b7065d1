"""Pipeline parallelism: the decoder layers split into consecutive stages, one a rank
(docs/cluster.md).

Rank ``s`` of the pipeline group holds stage ``s``'s layers (the first stages one more
where the count does not divide); :class:`Skipped`, weightless, stands in the others'
places. The embeddings, final norm and LM head are on every rank (split by vocabulary over
a stage's tensor-parallel ranks where it has them), so every rank runs every row to the
same logits and loss, and the trainer runs unchanged.

Activations are handed on (:class:`_Handoff`) by a broadcast from the producing stage
before each stage's first layer and before the final norm; the backward broadcasts each
hand-off's gradient from the rank that consumed it, so the whole parameters' gradients are
the same on every rank without a reduction, and the norm counts each stage's layers once
(:data:`GROUP_ATTR`). The schedule is the plain one, one stage computing at a time (a
bubble of ``(P - 1) / P``): it buys memory, a rank holding ``1 / P`` of the layers with
their gradients, optimizer state and activations. :class:`PipelineLayout` gathers the
stages to rank 0 to export or save them in one worker's files."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp

from rlpost.train.dp import DataParallel, full_tensor, layers_name, resharded
from rlpost.train.layout import ShardedLayout, whole_tensors

GROUP_ATTR = "pipeline_group"
"""Set on a stage's own parameters: the pipeline's process group their norm is summed over."""


def stage_ranges(layers: int, pp: int) -> list[range]:
    """The layer indices of each of ``pp`` stages: consecutive, sizes differing by at most
    one (the first stages the larger)."""
    base, extra = divmod(layers, pp)
    edges = [s * base + min(s, extra) for s in range(pp + 1)]
    return [range(lo, hi) for lo, hi in itertools.pairwise(edges)]


def split_error(config, pp: int) -> str | None:
    """Why ``pp`` stages cannot split a model of ``config`` (one line), or None."""
    n = getattr(config, "num_hidden_layers", None)
    if pp == 1 or (n or 0) >= pp:
        return None
    if n is None:
        return (
            f"cluster.pipeline_parallel={pp}: the model ({type(config).__name__}) has no "
            "num_hidden_layers; pipeline stages split decoder layers, set it to 1"
        )
    return (
        f"cluster.pipeline_parallel={pp} is more stages than the model's "
        f"num_hidden_layers={n}; use at most {n}"
    )


class Skipped(nn.Module):
    """A decoder layer another stage holds: the hidden states pass through as they are."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Handoff(torch.autograd.Function):
    """``x`` broadcast from rank ``src``, its gradient from ``consumer`` (None: as it is)."""

    @staticmethod
    def forward(ctx, x, src, consumer, group):
        ctx.consumer, ctx.group = consumer, group
        if src is None:
            return x.view_as(x)
        y = x.detach().contiguous().clone()
        dist.broadcast(y, group_src=src, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        if ctx.consumer is not None:
            dist.broadcast(g, group_src=ctx.consumer, group=ctx.group)
        return g, None, None, None


def _handoff_hook(src: int | None, consumer: int | None, group):
    def hook(module, args):
        return (_Handoff.apply(args[0], src, consumer, group), *args[1:])

    return hook


def layers_prefix(model: nn.Module) -> str:
    """The state-dict prefix of ``model``'s decoder layers (``model.layers.``)."""
    if (name := layers_name(model)) is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to split into stages")
    return f"{name}."


def pipeline(
    model: nn.Module,
    group,
    *,
    dp_mesh=None,
    tp_mesh=None,
    bf16: bool = False,
    trainable: bool = True,
) -> nn.Module:
    """Keep this rank's stage of ``model``'s decoder layers (``group``: the pipeline's
    ranks, in stage order) and hand activations between the stages; in place, returned.
    ``tp_mesh``: the tensor-parallel axis the stage's layers, the embedding and the head
    are then split over (:func:`rlpost.train.tp.parallelize`); ``dp_mesh``: the
    data-parallel axis the stage is then sharded over with FSDP2
    (:func:`rlpost.train.dp.shard_model`, ``bf16`` and ``trainable`` as there).

    The weights are first made global rank 0's, so the stages are of one model whatever
    each rank built."""
    from rlpost.train.dp import non_reentrant_checkpointing, shard_model

    pp, stage = dist.get_world_size(group), dist.get_rank(group)
    prefix = layers_prefix(model)[:-1]
    decoder, layers = model.get_submodule(prefix.rpartition(".")[0]), model.get_submodule(prefix)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(model).__name__} has no final norm after its decoder layers")
    non_reentrant_checkpointing(model)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    ranges = stage_ranges(len(layers), pp)
    for i in range(len(layers)):
        if i not in ranges[stage]:
            layers[i] = Skipped()
    if tp_mesh is not None:
        from rlpost.train.tp import parallelize

        parallelize(model, tp_mesh, synced=True)
    if dp_mesh is not None:  # sharding makes new parameters: marked after it
        shard_model(model, bf16=bf16, trainable=trainable, mesh=dp_mesh, synced=True)
    for p in layers.parameters():
        setattr(p, GROUP_ATTR, group)
    # stage 0's input is every rank's embeddings; its gradient is the one stage 0 computed
    layers[0].register_forward_pre_hook(_handoff_hook(None, 0, group))
    for s in range(1, pp):
        layers[ranges[s].start].register_forward_pre_hook(_handoff_hook(s - 1, s, group))
    norm.register_forward_pre_hook(_handoff_hook(pp - 1, None, group))
    return model


# ------------------------------------------------------------------- layout


def _gather_named(items: dict, group) -> dict:
    """Every stage's ``items`` merged on the group's first rank (the others get {})."""
    parts = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(items, parts, group_dst=0, group=group)
    return {} if parts is None else {k: v for part in parts for k, v in part.items()}


class PipelineLayout(ShardedLayout):
    """``model`` and ``ref`` split into stages over the pipeline axis of ``ranks``'s mesh
    (:func:`pipeline`), each sharded over its data-parallel axis where it has more than
    one rank. ``names``: the whole model's trainable parameter names in its order (the
    optimizer's in one worker), ``keys``: its state-dict keys; both read before the split."""

    def __init__(self, model: nn.Module, ref: nn.Module | None, ranks: DataParallel, bf16: bool):
        super().__init__(model, ref, ranks)
        self.keys, self.prefix = list(model.state_dict()), layers_prefix(model)
        self.group = ranks.mesh["pp"].get_group()
        dp = ranks.mesh["dp"] if ranks.world > 1 else None
        tp = ranks.mesh["tp"] if ranks.mesh["tp"].size() > 1 else None
        for module, trainable in [(model, True), (ref, False)][: 1 + (ref is not None)]:
            pipeline(module, self.group, dp_mesh=dp, tp_mesh=tp, bf16=bf16, trainable=trainable)

    def _whole(self, module: nn.Module, *, state: bool) -> dict[str, torch.Tensor]:
        """Each stage's part (shards gathered; the whole modules from stage 0) merged on
        rank 0, in the model's key order (a tied weight once, as engines expect)."""
        resharded(module)
        mine = module.state_dict() if state else dict(module.named_parameters())
        mine = {n: full_tensor(t).detach().cpu() for n, t in mine.items() if self._sent(n)}
        merged = _gather_named(mine, self.group)
        return {n: merged[n] for n in self.keys if n in merged}

    def _sent(self, name: str) -> bool:
        """Whether this rank sends ``name`` when the stages are gathered."""
        return dist.get_rank(self.group) == 0 or name.startswith(self.prefix)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole state keyed by parameter name on rank 0 (a collective), as sharded
        workers save it, so a checkpoint resumes on any layout."""
        state = dcp.get_optimizer_state_dict(self.model, optimizer, options=whole_tensors())
        mine = {n: v for n, v in state["state"].items() if self._sent(n)}
        merged = _gather_named(mine, self.group)
        if not self.writes_files:
            return {}
        order = [n for n in self.names if n in merged]
        groups = [{**g, "params": order} for g in state["param_groups"][:1]]
        return {"state": {n: merged[n] for n in order}, "param_groups": groups}
