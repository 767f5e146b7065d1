"""Streamed sources (``data.sources[i].stream``) in a run: their samplers, their start
check and their rows in ``RUN_DIR/data_report.json``.

The start checks only the first rows of a streamed file (:func:`preflight_stream`);
every later bad row is counted when the stream meets it, and the data report is
rewritten with those counts at every checkpoint and at the end of the run
(:func:`update_data_report`), so ``summary.json`` has them too.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from rlpost.config import Config, SourceConfig
from rlpost.data import LoadReport
from rlpost.data.stream import StreamSampler, preflight
from rlpost.models.loading import load_tokenizer
from rlpost.models.tiny import build_char_tokenizer
from rlpost.pipeline.build import fit_to_model
from rlpost.pipeline.preflight import DATA_REPORT


def _args(cfg: Config, src: SourceConfig) -> dict:
    return dict(
        path=src.train_path,
        name=src.name,
        on_bad_row=cfg.data.on_bad_row,
        prompt_field=src.prompt_field,
        answer_field=src.answer_field,
        template=src.prompt_template,
    )


def _fit(cfg: Config, src: SourceConfig):
    """The stream's row fitter: rendered and checked against the model's context, with
    the tokenizer loaded once."""
    tokenizer = build_char_tokenizer() if cfg.model.path is None else load_tokenizer(cfg.model.path)
    return partial(fit_to_model, cfg, system_prompt=src.system_prompt, tokenizer=tokenizer)


def preflight_stream(cfg: Config, src: SourceConfig) -> None:
    """The start's check of a streamed source: its first rows only (DataError if none fits)."""
    preflight(_args(cfg, src), _fit(cfg, src))


def stream_samplers(cfg: Config) -> dict:
    """``{name: seed -> StreamSampler}`` of the streamed sources (for make_sampler)."""
    out = {}
    for src in cfg.data.sources:
        if src.stream:
            make = partial(StreamSampler, **_args(cfg, src), buffer=src.shuffle_buffer)
            out[src.name] = lambda seed, make=make, fit=_fit(cfg, src): make(fit=fit, seed=seed)
    return out


def update_data_report(run_dir: Path, sampler) -> None:
    """Write the streamed sources' rows met so far into ``data_report.json`` (their entries
    under ``train.sources`` and the train totals); nothing without a streamed source."""
    streams = {
        n: s for n, s in getattr(sampler, "samplers", {}).items() if isinstance(s, StreamSampler)
    }
    path = run_dir / DATA_REPORT
    if not streams or not path.is_file():
        return
    detail = json.loads(path.read_text())
    train = detail.get("train", {})
    sources = train.setdefault("sources", {})
    for name, s in streams.items():
        r = s.report_copy()
        sources[name] = {
            **r.counts("train"),
            "skipped_rows": r.problems,
            "epoch": s.epoch,
            "streamed": True,
        }
    total = LoadReport()
    for entry in sources.values():
        total.rows += entry["train_rows"]
        total.skipped_by_reason.update(
            {
                k[len("train_skipped_") :]: v
                for k, v in entry.items()
                if k.startswith("train_skipped_")
            }
        )
        total.problems.extend(entry["skipped_rows"])
    detail["train"] = {**total.counts("train"), "skipped_rows": total.problems, "sources": sources}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(detail, indent=2))
    tmp.replace(path)
