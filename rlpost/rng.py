"""The process-wide random states (python, numpy, torch), saved and restored as one.

Every worker saves its own process's states in its checkpoint part, so a run
resumes exactly whether its workers share a process or not.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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
