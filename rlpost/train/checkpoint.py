"""Checkpoints that resume a run exactly.

A checkpoint directory ``RUN_DIR/checkpoints/step_N`` holds the policy (an HF
directory, loadable on its own), the reference model when one is kept,
``trainer_state.pt`` (optimizer, scheduler, shuffle generator, critic, the
trainer's RNG states) and ``state.pt`` (the step, the data cursor, controller
state, the rollout worker's sampling generator and carried samples, the loop's
RNG states). ``latest`` names the newest complete checkpoint; it is written last, so
a crash mid-save never leaves a half checkpoint marked as latest.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlpost.config import ConfigError
from rlpost.data.reasoning_gym import TaskEntry
from rlpost.rng import rng_state
from rlpost.statefile import (
    StateFileError,
    allow,
    atomic_write,
    check_state_file,
    clear,
    fresh_dir,
    fsync_tree,
    save_state,
)
from rlpost.statefile import load_state as load_state_file
from rlpost.types import Prompt

allow(Prompt, TaskEntry)  # prompts drawn ahead of the trainer are part of the loop's state
TRAINER_STATE = "trainer_state.pt"  # the trainer worker's part (optimizer, scheduler, RNG)


def claim_run_dir(run_dir: Path, *, overwrite: bool, config_text: str) -> Path:
    """Create ``run_dir`` for a fresh run and write its ``config.yaml``.

    Starting a run never deletes anything by accident: a run directory that already
    holds files is refused (its name and both ways out in one line) unless
    ``overwrite`` says to replace it. Callers validate their inputs before calling
    this, so a start that fails leaves any earlier run exactly as it was."""
    run_dir = Path(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"run directory {str(run_dir)!r} already exists; continue it with "
                f"--resume {run_dir}, replace it with --overwrite, or choose another run.name"
            )
        if not (run_dir / "config.yaml").is_file():  # only a run's directory is replaced
            raise ConfigError(
                f"run directory {str(run_dir)!r} holds files but no run (no config.yaml); "
                "--overwrite replaces runs only: choose another run.name or move the files"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_text)
    return run_dir


def save_checkpoint(
    run_dir: Path,
    step: int,
    write_parts: Callable[[Path], None],
    state: dict[str, Any],
    *,
    keep: int = 2,
) -> Path:
    """Write ``checkpoints/step_N`` atomically.

    ``write_parts(directory)`` writes the workers' parts (the trainer's
    ``model/``, an ordinary HF directory with the tokenizer that ``model.path``
    can load, ``ref_model/`` and its optimizer state); ``state`` (the loop's:
    step, data cursor, controllers, the rollout worker's state) goes to
    ``state.pt``. The directory is renamed into place and ``latest`` written
    last, so a crash mid-save never leaves a half checkpoint marked as latest."""
    root = run_dir / "checkpoints"
    out = root / f"step_{step}"
    tmp = fresh_dir(root / f".step_{step}.tmp")
    write_parts(tmp)
    save_state({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    fsync_tree(tmp)  # every part on disk before the rename makes it the checkpoint
    replaced = None
    if out.exists():  # the same step saved again: the old copy stays until the new is in place
        replaced = root / f".step_{step}.old"
        clear(replaced)
        out.rename(replaced)
    tmp.rename(out)
    with atomic_write(root / "latest", "w") as fh:  # ``latest`` is always whole
        fh.write(out.name)
    if replaced is not None:
        shutil.rmtree(replaced)
    # the newest ``keep`` by step, this one always among them (after a rollback it may not
    # be the highest step on disk)
    others = sorted((p for p in _complete(root) if p != out), key=latest_step, reverse=True)
    for old in others[max(0, keep - 1) :]:
        shutil.rmtree(old)
    return out


def _complete(root: Path) -> list[Path]:
    """The checkpoint directories under ``root`` that were renamed into place."""
    return [p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names; without a usable marker, the highest complete step."""
    root = run_dir / "checkpoints"
    marker = root / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if marker.read_text().strip() and (path / "state.pt").is_file():
            return path
    done = [p for p in _complete(root) if (p / "state.pt").is_file()] if root.is_dir() else []
    return max(done, key=latest_step) if done else None


def load_state(ckpt: Path) -> dict[str, Any]:
    """The loop's state of a checkpoint, loaded without unpickling code
    (:class:`~rlpost.statefile.StateFileError` for a torn or tampered file)."""
    return load_state_file(ckpt / "state.pt")


def older_checkpoints(run_dir: Path, than: Path) -> list[Path]:
    """The complete checkpoints saved at a lower step than ``than``, newest first: where a
    resume falls back to when ``than`` fails to load."""
    root = run_dir / "checkpoints"
    done = [p for p in _complete(root) if (p / "state.pt").is_file() and p != than]
    return sorted(
        (p for p in done if latest_step(p) < latest_step(than)), key=latest_step, reverse=True
    )


def usable_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that loads: ``latest``, or when its files are torn or refused,
    the complete step before it (a one-line warning for each one passed over)."""
    first = latest_checkpoint(run_dir)
    if first is None:
        return None
    for ckpt in [first, *older_checkpoints(run_dir, first)]:
        why = _unloadable(ckpt)
        if why is None:
            return ckpt
        print(f"rlpost: warning: {why}; falling back to the checkpoint before", file=sys.stderr)
    raise StateFileError(
        f"no checkpoint under {run_dir / 'checkpoints'} loads (see the warnings above); restore "
        "one from a trusted copy or start a new run"
    )


def _unloadable(ckpt: Path) -> str | None:
    """Why ``ckpt`` would fail to restore, or None; reads the small loop state whole and
    checks the trainer's state without loading its tensors."""
    try:
        load_state_file(ckpt / "state.pt")
        check_state_file(ckpt / TRAINER_STATE)
    except StateFileError as exc:
        return str(exc)
    if not ((ckpt / "model" / "config.json").is_file() or (ckpt / "adapter").is_dir()):
        return f"checkpoint {ckpt} has no model"
    return None


__all__ = [
    "StateFileError",
    "claim_run_dir",
    "latest_checkpoint",
    "latest_step",
    "load_state",
    "older_checkpoints",
    "save_checkpoint",
    "usable_checkpoint",
]


def latest_step(ckpt: Path | None) -> int:
    """The step a checkpoint directory was saved at (0 without one)."""
    return 0 if ckpt is None else int(ckpt.name.split("_")[1])
