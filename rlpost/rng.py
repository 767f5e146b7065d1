"""Seeds derived from the run's seed, and the process-wide random states saved as one.

:func:`derive` is the one place a stream's seed comes from: a fixed linear form per purpose
(:data:`STREAMS`), so no two purposes share a stream.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

STREAMS: dict[str, tuple[int, tuple[int, ...], int]] = {
    # purpose: (factor of the seed, factor of each index, offset)
    "actor_shuffle": (1, (), 7),  # the trainer's mini-batch order
    "critic_shuffle": (1, (), 11),  # the critic's, independent of the actor's
    "eval": (1, (), 10_007),  # held-out sampling: never shifts the training samples
    "epoch_order": (100_003, (1,), 0),  # (epoch): a sampler's or stream's order
    "source": (7_919, (1,), 0),  # (source index): each data source's own sampler
    "source_pick": (1_000_003, (1,), 0),  # (batch): which source each prompt comes from
    "worker": (1, (7_919, 104_729), 0),  # (worker index, restart count)
    "session": (1, (1_000,), 0),  # (sample index): an agent session's sampling seed
}


def derive(seed: int, purpose: str, *index: int) -> int:
    """The seed of ``purpose``'s stream (:data:`STREAMS`) for the run's ``seed``."""
    factor, weights, offset = STREAMS[purpose]
    if len(index) != len(weights):
        raise ValueError(f"seed stream {purpose!r} takes {len(weights)} indices, got {index}")
    return factor * seed + sum(w * i for w, i in zip(weights, index, strict=True)) + offset


def rng_state() -> dict[str, Any]:
    """The states as plain data (numpy's key as a tensor), so a state file loads without
    unpickling (``rlpost.statefile``)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached = state["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state((name, key.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
