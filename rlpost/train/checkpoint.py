"""Checkpoints that resume a run exactly.

A checkpoint directory ``RUN_DIR/checkpoints/step_N`` holds the policy (an HF
directory, loadable on its own), the reference model when one is kept, and
``state.pt`` with the optimizer, scheduler, RNG states (python, numpy, torch,
the engine's sampling generator), the step, the data cursor and any controller
state. ``latest`` names the newest complete checkpoint; it is written last, so
a crash mid-save never leaves a half checkpoint marked as latest.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlpost.config import ConfigError


def claim_run_dir(run_dir: Path, *, overwrite: bool, config_text: str) -> Path:
    """Create ``run_dir`` for a fresh run and write its ``config.yaml``.

    Starting a run never deletes anything by accident: a run directory that already
    holds files is refused (its name and both ways out in one line) unless
    ``overwrite`` says to replace it. Callers validate their inputs before calling
    this, so a start that fails leaves any earlier run exactly as it was.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"run directory {str(run_dir)!r} already exists; continue it with "
                f"--resume {run_dir}, replace it with --overwrite, or choose another run.name"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_text)
    return run_dir


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    state: dict[str, Any],
    *,
    ref_model=None,
    tokenizer=None,
    keep: int = 2,
) -> Path:
    """Write ``checkpoints/step_N`` atomically; ``step_N/model`` (with the tokenizer) is an
    ordinary HF directory that ``model.path`` can load."""
    root = run_dir / "checkpoints"
    out = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    if ref_model is not None:
        ref_model.save_pretrained(tmp / "ref_model")
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    (root / "latest").write_text(out.name)
    for old in sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
        shutil.rmtree(old)
    return out


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    path = run_dir / "checkpoints" / marker.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_state(ckpt: Path) -> dict[str, Any]:
    # weights_only=False: the state holds RNG tuples and numpy arrays we wrote ourselves.
    return torch.load(ckpt / "state.pt", weights_only=False)


def latest_step(ckpt: Path | None) -> int:
    """The step a checkpoint directory was saved at (0 without one)."""
    return 0 if ckpt is None else int(ckpt.name.split("_")[1])
