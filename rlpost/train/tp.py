"""Tensor parallelism: each decoder layer's matrices, the embedding and the LM head split
over the ranks of a mesh axis (docs/cluster.md).

The ranks form a ``(dp, tp)`` device mesh: rank ``d * tp + t`` holds slice ``t`` of
replica ``d``, so a tensor-parallel group is neighbours (one node). Inside a layer, torch's
DTensor plans make Megatron's split: q/k/v and gate/up column-wise (a rank's heads and MLP
width), o and down row-wise (partial sums all-reduced); between them activations are plain
tensors, so attention runs unchanged on the local heads. The embedding and the head split
by vocabulary rows (a tie kept): lookups are all-reduced, and the chunked head
(:mod:`rlpost.train.lm_head`) reduces its softmax over the group. The norms stay whole.
Then FSDP2 shards every parameter over the data-parallel axis
(:func:`rlpost.train.dp.shard_model`).

The update is one worker's: a group's ranks run the same rows, a split matrix's gradient
is its slice's whole gradient, a whole parameter's the same on every rank, and the norm
counts each slice once (:func:`rlpost.train.optim.clip_grad_norm`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

COLUMN = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROW = ("self_attn.o_proj", "mlp.down_proj")


def split_error(config, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split a model of ``config`` (one line,
    ``cluster.tensor_parallel=...: reason; fix``), or None. (That ``tp`` divides the
    workers is :class:`~rlpost.resolved.TrainerLayout`'s: it needs no model.)"""
    if tp == 1:
        return None
    heads = getattr(config, "num_attention_heads", None)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        n = getattr(config, key, None)
        n = heads if n is None and key == "num_key_value_heads" else n  # no GQA: one per head
        if n is None:
            return (
                f"cluster.tensor_parallel={tp}: the model ({type(config).__name__}) has no "
                f"{key}; tensor parallelism splits Llama/Qwen-family decoders, set it to 1"
            )
        if n % tp:
            return (
                f"cluster.tensor_parallel={tp} does not divide the model's {key}={n}; "
                f"use a divisor of {n}"
            )
    return None


def device_mesh(layout, device_type: str = "cpu"):
    """The ``("dp", "tp")`` mesh of ``layout`` (a :class:`~rlpost.resolved.TrainerLayout`,
    its sizes checked when it was built; every rank calls it); with pipeline stages
    (``layout.pp > 1``) the ``("dp", "pp", "tp")`` one, stages outside slices."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.pp == 1:
        shape, names = (layout.dp, layout.tp), ("dp", "tp")
    else:
        shape, names = (layout.dp, layout.pp, layout.tp), ("dp", "pp", "tp")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def parallelize(model: nn.Module, tp_mesh, *, synced: bool = False) -> nn.Module:
    """Split ``model``'s decoder layers over ``tp_mesh`` (1-D) in place, a layer without
    weights (another pipeline stage's) left as it is, and its embedding and LM head
    (:func:`vocab_modules`; else both stay whole) by vocabulary rows, a tie kept; returned.

    The weights are first made rank 0's on every rank of the whole group (unless
    ``synced``: they are), so the slices are of one model whatever each rank built;
    gradient checkpointing is made non-reentrant."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from rlpost.train.dp import decoder_layers, non_reentrant_checkpointing

    non_reentrant_checkpointing(model)
    with torch.no_grad():
        for t in [] if synced else list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    plan = {name: ColwiseParallel() for name in COLUMN} | {name: RowwiseParallel() for name in ROW}
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers to split")
    for layer in layers:
        if any(True for _ in layer.parameters()):
            parallelize_module(layer, tp_mesh, plan)
    if (found := vocab_modules(model)) is not None:
        embed, head = found
        tied = head.weight is embed.weight
        # a full-logits forward gathers each rank's [.., V/T] logits
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        if tied:  # each plan made a parameter of its own: one again
            embed.weight = head.weight
    return model


def vocab_modules(model: nn.Module) -> tuple[nn.Embedding, nn.Linear] | None:
    """(token embedding, LM head) of ``model`` where both are plain layers (the ones
    :func:`parallelize` splits by vocabulary), else None."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    plain = type(embed) is nn.Embedding and type(head) is nn.Linear
    return (embed, head) if plain else None


def vocab_shard(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """(weight, bias, (group, first row, the whole parameter) or None): this rank's rows of
    a head split by vocabulary (:func:`parallelize`), else the head's own (whole, or FSDP2's
    shards, gathered before use)."""
    from torch.distributed.tensor import DTensor

    w, b = head.weight, getattr(head, "bias", None)  # an embedding has none
    if not isinstance(w, DTensor) or w.device_mesh.mesh_dim_names != ("tp",):
        return w, b, None
    local, group = w.to_local(), w.device_mesh.get_group()
    return local, None if b is None else b.to_local(), (group, dist.get_rank(group) * len(local), w)
