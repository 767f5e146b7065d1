"""The in-process weight channel: the trainer's tensors copied into the engine's model.

Weights travel layer by layer (``named_parameters`` order) so a later channel
(torch.distributed, shared disk, HTTP) can stream the same sequence in buckets;
each push carries the policy version the engine reports from then on.
"""

from __future__ import annotations

import time

import torch

from rlpost.sync.weight_sync import SyncStats


class InProcessChannel:
    """Pushes a model's weights into an engine living in the same process.

    The direct copy: no staging, no codec, the cheapest path when trainer and
    engine share a process. ``build_weight_sync`` with ``channel=inprocess``
    adds codecs, delta, atomic commit and verification on top.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    @torch.no_grad()
    def push(self, model: torch.nn.Module, version: int) -> SyncStats:
        start = time.perf_counter()
        size = 0

        def stream():
            nonlocal size
            for name, p in model.named_parameters():
                size += p.numel() * p.element_size()
                yield name, p.detach()

        self.engine.load_weights(stream(), version)
        return SyncStats(version=version, seconds=time.perf_counter() - start, bytes=size)
