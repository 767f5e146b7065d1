"""Pipeline parallelism: the decoder layers split into consecutive stages, one a rank
(docs/cluster.md).

Rank ``s`` of the pipeline group holds stage ``s``'s layers (the first stages one more
where the count does not divide); :class:`Skipped`, weightless, stands in the others'
places. The embeddings, final norm and LM head are on every rank (split by vocabulary over
a stage's tensor-parallel ranks where it has them).

A training step runs the 1F1B schedule, point to point (:class:`Stages`); passes without
a gradient run every row on every rank. :class:`PipelineLayout` gathers the stages to rank
0 to export or save them in one worker's files."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp
from torch.distributed.tensor import DTensor

from rlpost.train.dp import DataParallel, full_tensor, layers_name, resharded
from rlpost.train.layout import ShardedLayout, whole_tensors
from rlpost.train.optim import accumulate_grads

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


def one_f_one_b(pp: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s passes over ``micro_batches`` micro-batches, in order: ``("F", i)``
    a forward, ``("B", i)`` a backward. ``P - 1 - s`` forwards ahead, then a forward and a
    backward in turn, then the backwards left."""
    ahead = min(pp - 1 - stage, micro_batches)
    order = [("F", i) for i in range(ahead)]
    for i in range(ahead, micro_batches):
        order += [("F", i), ("B", i - ahead)]
    return order + [("B", i) for i in range(micro_batches - ahead, micro_batches)]


class StageDone(Exception):
    """Raised out of a stage's forward with gradients at its last layer, for
    :meth:`Stages.accumulate`: ``loss`` stands for the rest of the model, its backward
    receives the gradient."""

    def __init__(self, loss: torch.Tensor):
        super().__init__("a pipeline stage's training forward runs in Stages.accumulate")
        self.loss = loss


class _Receive(torch.autograd.Function):
    """The previous stage's output in ``like``'s shape; the gradient sent back to it.
    ``anchor`` (requiring a gradient) makes the backward run with frozen inputs too.
    ``like`` comes detached: this rank's own lookup, made for its shape alone, is then no
    part of the backward (in it a vocabulary-split embedding's redistribution would get
    autograd's zero gradient as a plain tensor, not a DTensor, and fail)."""

    @staticmethod
    def forward(ctx, like, anchor, stages, src):
        ctx.stages, ctx.src = stages, src
        y = torch.empty_like(like)
        dist.recv(y, group_src=src, group=stages.group)
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.stages.send(grad, ctx.src)
        return None, None, None, None


class _Send(torch.autograd.Function):
    """``x`` sent on to the next stage, a zero loss in its place whose backward receives
    ``x``'s gradient from that stage."""

    @staticmethod
    def forward(ctx, x, anchor, stages, dst):
        ctx.stages, ctx.dst = stages, dst
        ctx.like = {"size": x.shape, "dtype": x.dtype, "device": x.device}  # not x: no memory
        stages.send(x.detach(), dst)
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _):
        g = torch.empty(**ctx.like)
        dist.recv(g, group_src=ctx.dst, group=ctx.stages.group)
        return g, None, None, None


class Stages:
    """A model's pipeline stages seen from one rank, and the 1F1B schedule its training
    step runs (:meth:`accumulate`).

    A pass without a gradient (scoring) runs every row on every rank to the same logits:
    the hand-offs are broadcasts. A pass with one, in :meth:`accumulate`, receives the
    stage's input from the previous stage's rank, sends its output to the next and stops
    there (:class:`StageDone`); only the last stage runs the head and the loss.
    Each rank runs ``P - 1 - s`` forwards ahead, then one forward and one backward in
    turn (PipeDream-Flush's 1F1B): the stages compute different micro-batches at once,
    a bubble of ``(P - 1) / (M + P - 1)`` for ``M`` micro-batches, and a stage keeps at
    most ``P - s`` micro-batches' activations."""

    def __init__(self, group, params: list[nn.Parameter]):
        self.group, self.params = group, params  # params: trainable, grads summed in accumulate
        self.pp, self.stage = dist.get_world_size(group), dist.get_rank(group)
        self._sends: list = []
        self._anchor = torch.zeros((), requires_grad=True)

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous()
        self._sends.append((dist.isend(t, group_dst=dst, group=self.group), t))

    def hook(self, boundary: int):
        """The forward pre-hook before stage ``boundary``'s first layer (``P``: the norm)."""
        src = None if boundary == 0 else boundary - 1

        def hook(module, args):
            x = args[0]
            if not torch.is_grad_enabled():  # a scoring pass: every rank runs every row
                if src is not None:
                    x = x.contiguous().clone()
                    dist.broadcast(x, group_src=src, group=self.group)
            elif boundary == self.stage and src is not None:
                x = _Receive.apply(x.detach(), self._anchor, self, src)
            elif boundary == self.stage + 1 and boundary < self.pp:
                raise StageDone(_Send.apply(x, self._anchor, self, boundary))
            return (x, *args[1:])

        return hook

    def accumulate(self, micro_batches, micro_loss):
        """(summed loss, summed statistics) of ``micro_loss`` over ``micro_batches``, the
        gradients accumulated: the 1F1B schedule over the stages, then the whole
        parameters' gradients (the embeddings' from stage 0, the norm's and head's from
        the last) summed over the stages and the last stage's loss and statistics given
        to every rank."""
        micros = list(micro_batches)

        def loss_of(micro):
            try:
                return micro_loss(micro)
            except StageDone as done:  # not the last stage: its output went on
                return done.loss, {}

        try:
            order = one_f_one_b(self.pp, self.stage, len(micros))
            total, stats = accumulate_grads(micros, loss_of, order)
            for work, _ in self._sends:
                work.wait()
        finally:
            self._sends = []
        self._sum_whole_grads()
        out = [(total, stats)]
        dist.broadcast_object_list(out, group_src=self.pp - 1, group=self.group)
        return out[0]

    def _sum_whole_grads(self) -> None:
        """Sum the gradients of the parameters every rank holds whole over the stages
        (each came from one stage); one that no stage's backward reached stays None."""
        whole = [p for p in self.params if not hasattr(p, GROUP_ATTR)]
        reached = torch.tensor([p.grad is not None for p in whole], dtype=torch.int32)
        dist.all_reduce(reached, group=self.group)
        for p, n in zip(whole, reached.tolist(), strict=True):
            if n:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif isinstance(p, DTensor) and p.grad.placements != p.placements:
                    # a vocabulary-split embedding's lookup gives its gradient whole
                    # (Replicate): this rank's rows of it, as the weight holds them
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                dist.all_reduce(getattr(p.grad, "_local_tensor", p.grad), group=self.group)

    def from_last(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` made the last stage's on every rank (in place)."""
        dist.broadcast(t, group_src=self.pp - 1, group=self.group)
        return t


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
) -> Stages:
    """Keep this rank's stage of ``model``'s decoder layers (``group``: the pipeline's
    ranks, in stage order) and hand activations between the stages, in place; its
    :class:`Stages`.
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
    stages = Stages(group, [p for p in model.parameters() if p.requires_grad])
    # a hand-off before each stage's first layer (stage 0's: its own embeddings) and the norm
    for s in range(pp):
        layers[ranges[s].start].register_forward_pre_hook(stages.hook(s))
    norm.register_forward_pre_hook(stages.hook(pp))
    return stages


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
        self.stages = pipeline(model, self.group, dp_mesh=dp, tp_mesh=tp, bf16=bf16)
        if ref is not None:
            pipeline(ref, self.group, dp_mesh=dp, tp_mesh=tp, bf16=bf16, trainable=False)
        self.accumulate = self.stages.accumulate  # 1F1B

    def rows_filled(self, t: torch.Tensor) -> torch.Tensor:
        """As the sharded layout's, the rows filled by the last stage."""
        return self.stages.from_last(super().rows_filled(t))

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
