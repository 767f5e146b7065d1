"""A normal run prints rlpost's own lines only: no third-party warnings or progress bars.

The run puts the trainer and the rollout worker in processes of their own
(cluster.backend=process), so what a child process prints is checked too, with
gradient checkpointing on and a checkpoint saved every step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import small_overrides

ROOT = Path(__file__).resolve().parents[2]

# A Python warning ("FutureWarning: ...", "UserWarning: ..."), or a tqdm bar ("Writing
# model shards: 100%|...", "Loading weights: ..."). rlpost's own log lines read
# "WARNING rlpost.<module>: ...", which these do not match.
THIRD_PARTY = re.compile(r"\w*Warning\b|warnings\.warn|Writing model shards|Loading weights|\d+%\|")


@pytest.mark.slow
def test_train_prints_no_third_party_warnings_or_bars(tmp_path):
    overrides = small_overrides(
        tmp_path,
        **{
            "model.gradient_checkpointing": "true",
            "cluster.backend": "process",
            "train.steps": 2,
            "eval.every": 0,
        },
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any((tmp_path / "t" / "checkpoints").iterdir()), "no checkpoint: saving not exercised"
    leaked = [line for line in proc.stderr.splitlines() if THIRD_PARTY.search(line)]
    assert not leaked, "\n".join(leaked)
