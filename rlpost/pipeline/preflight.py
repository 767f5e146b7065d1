"""Checks of a run's inputs that must pass before its run directory is touched, and the
report of what they found.

A start that fails here leaves an earlier run of the same name as it was. Skipped rows are
counted on the console, in ``RUN_DIR/data_report.json``, ``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlpost.config import Config
from rlpost.data import LoadReport
from rlpost.models.loading import check_model_path
from rlpost.observe import Recorder
from rlpost.pipeline import build
from rlpost.types import Prompt

DATA_REPORT = "data_report.json"
SHOWN_PROBLEMS = 20


def check_inputs(
    cfg: Config, *, prompts: bool = True
) -> tuple[list[Prompt], list[Prompt], dict[str, LoadReport]]:
    """Check the model directory and load the data for the model: (train prompts, held-out
    prompts, load reports); ``prompts=False`` checks the model directory only."""
    if cfg.model.path is not None:
        check_model_path(cfg.model.path)
    if not prompts:
        return [], [], {}
    train, held_out, reports = build.load_data(cfg)
    shown = {"train": reports["train"], **({"eval": reports["eval"]} if held_out else {})}
    return train, held_out, shown


def data_counts(reports: dict[str, LoadReport]) -> dict[str, int]:
    """Flat counts: ``train_rows``, ``train_skipped``, ``train_skipped_<reason>``, same for eval."""
    return {k: n for split, report in reports.items() for k, n in report.counts(split).items()}


def report_data(run_dir: Path, reports: dict[str, LoadReport], *, fresh: bool) -> None:
    """Show skipped rows on the console and write them to the run directory."""
    detail = {
        split: {**r.counts(split), "skipped_rows": r.problems, **source_detail(split, r)}
        for split, r in reports.items()
    }
    (run_dir / DATA_REPORT).write_text(json.dumps(detail, indent=2))
    for split, r in reports.items():
        if not r.skipped:
            continue
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(r.skipped_by_reason.items()))
        print(
            f"data {split}: {r.rows} rows used, {r.skipped} skipped ({reasons}); "
            f"every one in {run_dir / DATA_REPORT}",
            file=sys.stderr,
        )
        for line in r.problems[:SHOWN_PROBLEMS]:
            print(f"  {line}", file=sys.stderr)
        if r.skipped > SHOWN_PROBLEMS:
            print(f"  ... and {r.skipped - SHOWN_PROBLEMS} more", file=sys.stderr)
    if fresh:
        recorder = Recorder(run_dir, start_step=0)
        recorder.record(0, {f"data_{k}": v for k, v in data_counts(reports).items()})
        recorder.close()


def read_data_counts(run_dir: Path) -> dict[str, int]:
    """The flat counts written by :func:`report_data` ({} when absent)."""
    path = run_dir / DATA_REPORT
    if not path.is_file():
        return {}
    detail = json.loads(path.read_text())
    skip = ("skipped_rows", "sources")
    return {k: v for split in detail.values() for k, v in split.items() if k not in skip}


def source_detail(split: str, report: LoadReport) -> dict:
    """``{"sources": {name: counts, skipped rows and info}}`` of a report that sums
    data.sources ({} for one source)."""
    if not report.sources:
        return {}
    return {
        "sources": {
            name: {**r.counts(split), "skipped_rows": r.problems, **r.info}
            for name, r in report.sources.items()
        }
    }
