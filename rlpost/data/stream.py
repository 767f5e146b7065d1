"""A file source read lazily (``task: {name: file, stream: true}``): rows shuffled by a buffer, never loaded whole.

JSONL is read line by line (a ``.json`` array is refused), Parquet by row group; rows are
checked as read and go through a buffer of ``shuffle_buffer`` rows seeded by the source's seed
and the epoch. The state is ``(epoch, rows drawn in it)``: a resume replays the epoch and drops
the rows drawn, a scan in constant memory instead of a checkpoint as large as the buffer.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

from rlpost.data.files import (
    DataError,
    LoadReport,
    check_row,
    is_json_array,
    jsonl_rows,
    row_prompt,
    valid_rows,
)
from rlpost.rng import derive
from rlpost.types import Prompt

STREAM_SUFFIXES = (".jsonl", ".json", ".parquet")
CHUNK = 256  # rows read, checked and rendered together (the tokenizer takes a batch)
PREFLIGHT_ROWS = CHUNK  # rows of a streamed file the start checks (not the whole file)

Fit = Callable[[list[Prompt], LoadReport], list[Prompt]]
"""Render prompts for the model and keep those that fit, counting the rest in the report."""


def raw_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line, row) of a JSONL file line by line or a Parquet file row group by row group;
    a row that cannot be read is an exception in place (as :func:`files.read_rows`)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=CHUNK)
            line = 0
            for batch in batches:
                for row in batch.to_pylist():
                    line += 1
                    yield line, row
        except OSError as exc:  # pyarrow's errors for a corrupt file are OSError subclasses
            raise DataError(f"{path}: cannot read Parquet ({exc})") from None
        return
    with path.open("rb") as f:
        yield from jsonl_rows(f)


def check_stream_path(path: str) -> Path:
    """``path`` as a streamable file, or DataError in one line."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset {path!r} does not exist")
    if p.is_dir() or p.suffix not in STREAM_SUFFIXES:
        raise DataError(f"{path}: stream reads .jsonl or .parquet, not {p.suffix or 'a directory'}")
    if is_json_array(p):
        raise DataError(
            f"{path}: holds one JSON array, which cannot be read a row at a time; write it as "
            f"JSON Lines (jq -c '.[]' {p.name} > {p.stem}.jsonl) or set task.stream: false"
        )
    return p


class StreamSampler:
    """A :class:`~rlpost.data.sampler.PromptSampler` of one streamed source's rows, one at a
    time; ``report`` counts the first pass."""

    batch_size = 1

    def __init__(
        self,
        path: str,
        *,
        name: str,
        fit: Fit,
        buffer: int,
        seed: int,
        on_bad_row: str,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        template: str = "{prompt}",
    ) -> None:
        self.path = check_stream_path(path)
        self.name, self.fit, self.buffer, self.seed = name, fit, buffer, seed
        self.on_bad_row = on_bad_row
        self.check = partial(
            check_row, prompt_field=prompt_field, answer_field=answer_field, template=template
        )
        self.make = partial(
            row_prompt, prompt_field=prompt_field, answer_field=answer_field, template=template
        )
        self.report = LoadReport()
        self.epoch, self.drawn = 0, 0
        self._counting = True
        self._lock = threading.Lock()  # a feed thread draws while a checkpoint reads the report
        self._it = self._order(0)

    def _prompts(self, report: LoadReport) -> Iterator[Prompt]:
        """Every usable row of the file, in file order, rendered; the rows met on the first
        pass are counted in ``report`` (not those a resume replays)."""
        rows = raw_rows(self.path)
        while chunk := list(islice(rows, CHUNK)):
            counted = self._counting and self.epoch == 0
            yield from self.chunk_prompts(chunk, report if counted else LoadReport())

    def chunk_prompts(self, chunk: list[tuple[int, Any]], report: LoadReport) -> list[Prompt]:
        """The usable rows of ``chunk`` rendered for the model; problems go to ``report``."""
        kept = []
        for line, row in valid_rows(self.path, self.check, self.on_bad_row, report, chunk):
            p = self.make(row, f"{self.name}/{self.path.name}:{line}")
            p.source = self.name
            kept.append(p)
        return self.fit(kept, report)

    def _order(self, epoch: int) -> Iterator[Prompt]:
        """Epoch ``epoch``'s rows through the shuffle buffer."""
        rng = random.Random(derive(self.seed, "epoch_order", epoch))
        held: list[Prompt] = []
        for p in self._prompts(self.report):
            if len(held) < self.buffer:
                held.append(p)
                continue
            j = rng.randrange(self.buffer)
            out, held[j] = held[j], p
            yield out
        rng.shuffle(held)
        yield from held

    def next_batch(self) -> list[Prompt]:
        with self._lock:
            for _ in range(2):  # at most one epoch boundary per row
                p = next(self._it, None)
                if p is not None:
                    self.drawn += 1
                    return [p]
                if self.drawn == 0:
                    raise DataError(
                        f"data.sources[{self.name}]: {self.path} has no usable rows "
                        f"({self.report.first_problem or 'it is empty'})"
                    )
                self.epoch, self.drawn = self.epoch + 1, 0
                self._it = self._order(self.epoch)
            raise AssertionError("unreachable: a new epoch draws its first row")

    def report_copy(self) -> LoadReport:
        """A snapshot of the rows met so far (safe while another thread draws)."""
        with self._lock:
            r = self.report
            return LoadReport(r.rows, r.skipped_by_reason.copy(), list(r.problems))

    def state_dict(self) -> dict:
        with self._lock:
            r = self.report
            return {
                "epoch": self.epoch,
                "drawn": self.drawn,
                "rows": r.rows,
                "skipped_by_reason": dict(r.skipped_by_reason),
                "problems": list(r.problems),
            }

    def load_state_dict(self, state: dict) -> None:
        """Replay epoch ``state["epoch"]`` up to the rows it had drawn; the report is the
        saved one (the replay meets rows already counted)."""
        if "drawn" not in state:
            raise DataError(
                f"data.sources[{self.name}]: the checkpoint saved this source unstreamed; "
                "resume with the run's own config"
            )
        with self._lock:
            self.epoch, self.drawn = int(state["epoch"]), int(state["drawn"])
            self.report = LoadReport(int(state["rows"]))
            self.report.skipped_by_reason.update(state["skipped_by_reason"])
            self.report.problems.extend(state["problems"])
            self._counting = False
            self._it = self._order(self.epoch)
            for _ in range(self.drawn):
                next(self._it)
            # rows read from here on were not met before the checkpoint
            self._counting = True


def preflight(sampler_args: dict, fit: Fit) -> list[Prompt]:
    """The usable rows among a streamed file's first :data:`PREFLIGHT_ROWS` (uncounted); a bad
    row under on_bad_row=error is refused now, none usable is a DataError."""
    s = StreamSampler(**sampler_args, fit=fit, buffer=1, seed=0)
    scratch = LoadReport()
    kept = s.chunk_prompts(list(islice(raw_rows(s.path), PREFLIGHT_ROWS)), scratch)
    if not kept:
        raise DataError(
            f"data.sources[{s.name}]: no usable row in the first {PREFLIGHT_ROWS} rows of "
            f"{s.path} ({scratch.first_problem or 'it is empty'})"
        )
    return kept
