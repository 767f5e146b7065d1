"""A minimal engine for sync tests: named tensors it serves and the version they belong to."""

from __future__ import annotations

import torch


class DictEngine:
    """Serves a dict of tensors; ``load_weights`` copies into them (shapes and names checked)."""

    def __init__(self, tensors: dict[str, torch.Tensor], version: int = 0) -> None:
        self.weights = {k: v.clone() for k, v in tensors.items()}
        self.version = version
        self.loads = 0

    def load_weights(self, named_tensors, version: int) -> None:
        for name, tensor in named_tensors:
            self.weights[name].copy_(tensor)
        self.version = version
        self.loads += 1


def toy_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 tensors named like a transformer's: embedding, a 2-D weight over block edges, a norm."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 48, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(130, 260, generator=g) * 0.02,
        "model.layers.0.input_layernorm.weight": 1 + 0.1 * torch.randn(48, generator=g),
        "lm_head.weight": torch.randn(300, 48, generator=g),
    }
