"""Streamed sources (``data.sources[i].task.stream``) in a run: their samplers, their start
check and their rows in ``RUN_DIR/data_report.json``.

The start checks only the first rows of a streamed file (``build.load_sources``);
every later bad row is counted when the stream meets it, and the data report is
rewritten with those counts at every checkpoint and at the end of the run
(:func:`update_data_report`), so ``summary.json`` has them too.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from rlpost.config import Config
from rlpost.data import LoadReport
from rlpost.data.stream import StreamSampler
from rlpost.pipeline.build import stream_args, stream_fit
from rlpost.pipeline.preflight import DATA_REPORT
from rlpost.statefile import atomic_write


def stream_samplers(cfg: Config) -> dict:
    """``{name: StreamSampler(seed=...)}`` of the streamed sources (for make_sampler)."""
    out = {}
    for src in cfg.data.sources:
        if getattr(src.task, "stream", False):
            fit, buffer = stream_fit(cfg, src), src.task.shuffle_buffer
            out[src.name] = partial(StreamSampler, **stream_args(cfg, src), fit=fit, buffer=buffer)
    return out


def update_data_report(run_dir: Path, sampler) -> None:
    """Write the streamed sources' rows met so far into ``data_report.json`` (their entries
    under ``train.sources`` and the train totals); nothing without a streamed source."""
    samplers = getattr(sampler, "samplers", {})
    streams = {n: s for n, s in samplers.items() if isinstance(s, StreamSampler)}
    path = run_dir / DATA_REPORT
    if not streams or not path.is_file():
        return
    detail = json.loads(path.read_text())
    train = detail.get("train", {})
    sources = train.setdefault("sources", {})
    for name, s in streams.items():
        r = s.report_copy()
        met = {"skipped_rows": r.problems, "epoch": s.epoch, "streamed": True}
        sources[name] = r.counts("train") | met
    total = LoadReport()
    for entry in sources.values():
        total.rows += entry["train_rows"]
        skip = "train_skipped_"
        total.skipped_by_reason.update(
            {k.removeprefix(skip): v for k, v in entry.items() if k.startswith(skip)}
        )
        total.problems.extend(entry["skipped_rows"])
    detail["train"] = {**total.counts("train"), "skipped_rows": total.problems, "sources": sources}
    with atomic_write(path, "w") as fh:
        fh.write(json.dumps(detail, indent=2))
