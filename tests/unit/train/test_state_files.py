"""State files load without unpickling code; a torn or tampered checkpoint falls back (CPU)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlpost.rng import rng_state, set_rng_state
from rlpost.statefile import StateFileError, check_state_file, load_state, save_state
from rlpost.train.checkpoint import TRAINER_STATE, save_checkpoint, usable_checkpoint
from rlpost.types import Prompt


class Payload:
    """What an attacker writes into a shared run directory: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_round_trip_of_what_rlpost_writes(tmp_path):
    np.random.seed(3)
    state = {"rng": rng_state(), "t": torch.arange(4), "pending": [[Prompt("1+1=", 2)]]}
    save_state(state, tmp_path / "s.pt")
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(())))
    back = load_state(tmp_path / "s.pt")
    assert back["pending"][0][0] == Prompt("1+1=", 2)
    set_rng_state(back["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == drawn
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file


@pytest.mark.parametrize("check", [load_state, check_state_file])
def test_a_tampered_state_file_is_refused_and_runs_nothing(tmp_path, check):
    marker = tmp_path / "owned"
    torch.save({"step": 3, "x": Payload(marker)}, tmp_path / "state.pt")
    with pytest.raises(StateFileError) as err:
        check(tmp_path / "state.pt")
    assert "refused" in str(err.value) and "system" in str(err.value)
    assert "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("check", [load_state, check_state_file])
def test_a_torn_state_file_is_one_line(tmp_path, check):
    save_state({"t": torch.zeros(1000)}, tmp_path / "state.pt")
    data = (tmp_path / "state.pt").read_bytes()
    (tmp_path / "state.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(StateFileError, match="torn or unreadable") as err:
        check(tmp_path / "state.pt")
    assert "\n" not in str(err.value)


def _checkpoint(run_dir: Path, step: int) -> Path:
    def parts(d: Path) -> None:
        (d / "model").mkdir()
        (d / "model" / "config.json").write_text("{}")
        save_state({"trainer": {"step": step}}, d / TRAINER_STATE)

    return save_checkpoint(run_dir, step, parts, {"sampler": {}}, keep=3)


def test_a_latest_that_fails_to_load_falls_back_to_the_step_before(tmp_path, capsys):
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 20)
    newest = _checkpoint(tmp_path, 30)
    assert usable_checkpoint(tmp_path) == newest
    torch.save({"x": Payload(tmp_path / "owned")}, newest / TRAINER_STATE)  # tampered
    (tmp_path / "checkpoints" / "step_20" / "state.pt").write_bytes(b"PK\x03\x04torn")
    assert usable_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_10"
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2 and "step_30" in warnings[0] and "step_20" in warnings[1]
    (tmp_path / "checkpoints" / "step_10" / "state.pt").unlink()
    with pytest.raises(StateFileError, match="no checkpoint"):
        usable_checkpoint(tmp_path)
