"""Checks of a run's inputs that must pass before its run directory is touched.

A start that fails here (a missing dataset, a bad row under ``on_bad_row=error``, a
model directory that is not a checkpoint) leaves an earlier run of the same name
exactly as it was.
"""

from __future__ import annotations

from rlpost.config import Config
from rlpost.models.loading import check_model_dir
from rlpost.pipeline import build


def check_inputs(cfg: Config) -> dict[str, int]:
    """Load the data and check the model directory; returns the data load counts."""
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path)
    _, _, counts = build.build_data(cfg)
    return counts
