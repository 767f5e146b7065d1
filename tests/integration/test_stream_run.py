"""A run with a streamed source: a run stopped mid-way and resumed draws exactly the rows of
an uninterrupted run, per source, and the stream's bad rows reach data_report.json."""

from __future__ import annotations

import json
import threading

from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides


def _sources(tmp_path) -> str:
    rows = [json.dumps({"prompt": f"say {i}:", "answer": str(i)}) for i in range(40)]
    rows[6] = "{torn"
    rows[25] = json.dumps({"prompt": "x" * 5000, "answer": "x"})  # longer than the model's context
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(rows) + "\n")
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "say 7:", "answer": "7"}) + "\n")
    arith = {"name": "arith", "task": {"name": "arith", "max_operand": 9, "eval_size": 8}}
    stream = {
        "name": "big",
        "task": {
            "name": "file",
            "train_path": str(big),
            "eval_path": str(held),
            "stream": True,
            "shuffle_buffer": 8,
        },
        "weight": 3,
    }
    return json.dumps([arith, stream])


def _run(tmp_path, sources: str, *, resume=None, stop_after: int | None = None):
    drawn: dict[int, list[str]] = {}
    stop = threading.Event()

    def seen(step, groups):
        drawn[step] = [g.prompt.uid for g in groups]
        if step == stop_after:
            stop.set()  # the loop ends after this step: final eval, checkpoint, summary

    over = {"data.sources": sources, "train.steps": 4, "data.on_bad_row": "skip"}
    cfg = load_config(None, small_overrides(tmp_path, **over))
    return train(cfg, resume=resume, stop=stop, on_groups=seen), drawn


def test_streamed_source_resumes_exactly_and_reports_its_bad_rows(tmp_path):
    sources = _sources(tmp_path)
    full, full_drawn = _run(tmp_path / "a", sources)
    streamed = [u for s in sorted(full_drawn) for u in full_drawn[s] if u.startswith("big/")]
    assert len(streamed) > 6 and all(u.startswith("big/big.jsonl:") for u in streamed)

    first, first_drawn = _run(tmp_path / "b", sources, stop_after=2)
    assert sorted(first_drawn) == [1, 2] and first.summary["steps"] == 2
    _, resumed = _run(tmp_path / "b", sources, resume=tmp_path / "b" / "t")
    assert sorted(resumed) == [3, 4]
    for step in (1, 2):
        assert first_drawn[step] == full_drawn[step]
    for step in (3, 4):
        assert resumed[step] == full_drawn[step]  # both sources, slot by slot

    report = json.loads((tmp_path / "b" / "t" / "data_report.json").read_text())
    big = report["train"]["sources"]["big"]
    assert big["streamed"] is True and big["train_rows"] == 38
    assert big["train_skipped_invalid_json"] == 1 and big["train_skipped_prompt_too_long"] == 1
    assert any(line.startswith(f"{tmp_path / 'big.jsonl'}:7:") for line in big["skipped_rows"])
    assert report["train"]["train_skipped"] == 2
    assert report["eval"]["sources"]["big"]["eval_rows"] == 1
    whole = json.loads((full.run_dir / "data_report.json").read_text())["train"]["sources"]["big"]
    assert whole == big  # the resumed run's counts are the uninterrupted run's
    assert full.summary["data"]["train_skipped_prompt_too_long"] == 1
