"""The run report renders in headless Chromium: a non-blank page with title and plots."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from rlpost.observe.recorder import Recorder
from rlpost.observe.report import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")


def make_full_run(run_dir: Path, steps: int = 30) -> None:
    """A run directory with every plotted series, a summary and samples."""
    with Recorder(run_dir) as rec:
        for step in range(1, steps + 1):
            rec.record(
                step,
                {
                    "reward_mean": 1 - math.exp(-step / 10),
                    "reward_std": 0.3 * math.exp(-step / 20),
                    "kl": 0.002 * step,
                    "response_length_mean": 60 - step,
                    "clip_frac": 0.05 + 0.01 * math.sin(step),
                    "rollout_tps": 900 + 50 * math.sin(step),
                    "sync_seconds": 0.05,
                    "sample_lag": 0.5,
                    "sample_drop_ratio": 0.02,
                    "loss": 0.5 * math.exp(-step / 15) + 0.05 * math.sin(step),
                    "grad_norm": 1 + 0.3 * math.cos(step),
                    "lr": 1e-4 * min(1.0, step / 5),
                    "entropy": 1.5 - 0.02 * step,
                },
            )
            if step % 5 == 0:
                rec.record(step, {"eval_accuracy": 0.1 + 0.02 * step})
            if step in (1, steps):  # greedy accuracy: measured at the start and the end
                rec.record(step, {"eval_greedy_accuracy": 0.3 + 0.01 * step})
    (run_dir / "summary.json").write_text(json.dumps({"final_accuracy": 0.7, "steps": steps}))
    (run_dir / "samples").mkdir()
    row = {
        "prompt": "2+2=?",
        "completion": "<answer>4</answer>",
        "score": 1.0,
        "components": {"acc": 1.0},
        "answer": "4",
    }
    (run_dir / "samples" / "step_000030.jsonl").write_text(json.dumps(row) + "\n")


def chromium(page: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            *extra,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_report_screenshot_is_not_blank(tmp_path):
    run_dir = tmp_path / "run"
    make_full_run(run_dir)
    page = write_report(run_dir)
    shot = tmp_path / "report.png"
    done = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1200,2000")
    assert shot.exists(), done.stderr[-2000:]
    image = matplotlib.image.imread(shot)[..., :3]
    assert image.shape[:2] == (2000, 1200)
    non_white = (image < 0.95).any(axis=-1).mean()
    rgb = (image * 255).astype(np.uint32).reshape(-1, 3)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
    assert non_white > 0.05, f"only {non_white:.1%} of the page is drawn"
    assert len(colours) > 50


def test_report_dom_has_title_and_inline_images(tmp_path):
    run_dir = tmp_path / "run"
    make_full_run(run_dir)
    done = chromium(write_report(run_dir), tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert "<title>rlpost run report: run</title>" in dom
    assert dom.count("<img") == 14  # every plotted series is present in this run
    assert "Not plotted" not in dom
    assert "&lt;answer&gt;4&lt;/answer&gt;" in dom


def test_comparison_of_two_runs_renders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_full_run(a)
    make_full_run(b, steps=20)
    page = write_report(a, b)
    shot = tmp_path / "compare.png"
    done = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1200,2000")
    assert shot.exists(), done.stderr[-2000:]
    image = matplotlib.image.imread(shot)[..., :3]
    assert (image < 0.95).any(axis=-1).mean() > 0.05
    dom = chromium(page, tmp_path, "--dump-dom").stdout
    assert "<title>rlpost comparison: a vs b</title>" in dom and dom.count("<img") == 14
    assert "<td><pre>4</pre></td>" in dom  # the reference answer next to the completion
