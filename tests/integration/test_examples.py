"""The examples in examples/ run as a user runs them, and do what they say (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_api_grpo_loop_learns(tmp_path):
    """The Python-API GRPO loop trains the warmed-up tiny model 20 steps; held-out accuracy
    (300 problems x 4 samples, fixed seeds) rises."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "api_grpo_loop.py"), "--steps", "20",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["steps"] == 20
    assert result["after"] > result["before"], result
