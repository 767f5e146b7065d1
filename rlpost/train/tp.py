"""Tensor parallelism: each decoder layer's matrices split over the ranks of a mesh axis.

The trainer's ranks form a ``(dp, tp)`` device mesh (``init_device_mesh``): rank
``d * tp + t`` holds tensor-parallel slice ``t`` of data-parallel replica ``d``, so
the ranks of one tensor-parallel group are neighbours (one node, the fast links).
Inside a decoder layer, the Megatron split of torch's DTensor plans
(``torch.distributed.tensor.parallel``): q/k/v and gate/up are column-wise (each rank
holds its heads, KV heads included, and its share of the MLP's intermediate width),
o and down row-wise (their partial sums all-reduced). Between the plans activations
are ordinary tensors, so the attention code runs unchanged on its local heads.

Everything else (embeddings, norms, the LM head) stays whole on every rank of the
group: its input is the same everywhere, so its output and gradient are too, and
the chunked LM head keeps its memory savings as it is. Then the data-parallel axis
shards every parameter with FSDP2 as one rank would (:func:`rlpost.train.dp.shard_model`).

Why the update equals one worker's: every rank of a tensor-parallel group runs the
same rows; a split matrix's gradient is the whole gradient of its slice, a whole
parameter's the same on every rank. The gradient norm counts each slice once
(:func:`rlpost.train.optim.clip_grad_norm`).
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
    workers is the rule table's: it needs no model.)"""
    if tp == 1:
        return None
    heads = getattr(config, "num_attention_heads", None)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
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


def device_mesh(world: int, tp: int, device_type: str = "cpu", pp: int = 1):
    """The ``("dp", "tp")`` mesh of this process group (every rank calls it); with
    pipeline stages (``pp > 1``) the ``("dp", "pp", "tp")`` one, stages outside slices."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % (tp * pp):
        raise ValueError(
            f"tensor_parallel={tp} x pipeline_parallel={pp} does not divide {world} ranks"
        )
    if pp == 1:
        return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    shape = (world // (tp * pp), pp, tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "pp", "tp"))


def parallelize(model: nn.Module, tp_mesh) -> nn.Module:
    """Split ``model``'s decoder layers over ``tp_mesh`` (1-D) in place; returned.

    The weights are first made rank 0's on every rank of the whole group, so the slices
    are of one model whatever each rank built; gradient checkpointing is made
    non-reentrant."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from rlpost.train.dp import decoder_layers, non_reentrant_checkpointing

    non_reentrant_checkpointing(model)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    plan = {name: ColwiseParallel() for name in COLUMN} | {name: RowwiseParallel() for name in ROW}
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers to split")
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)
    return model
