"""User datasets in JSONL or Parquet with a prompt and an answer field.

A malformed row (not an object, a missing or empty prompt, a missing answer) is
either skipped and counted or refused with the file and line, as
``data.on_bad_row`` says; it is never used silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rlpost.types import Prompt


class DataError(ValueError):
    """A dataset problem with file and line, in one line."""


@dataclass
class LoadReport:
    rows: int = 0
    skipped: int = 0
    first_problem: str = ""


def read_rows(path: Path) -> list[tuple[int, Any]]:
    if path.suffix in (".jsonl", ".json"):
        out = []
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    out.append((i, json.loads(line)))
                except json.JSONDecodeError as exc:
                    out.append((i, exc))
        return out
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises many types for a corrupt file
            raise DataError(f"{path}: cannot read Parquet ({exc})") from None
        return [(i, row) for i, row in enumerate(table.to_pylist(), start=1)]
    raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")


def _check_row(row: Any, prompt_field: str, answer_field: str) -> str | None:
    if isinstance(row, Exception):
        return f"not valid JSON ({row.msg})"
    if not isinstance(row, dict):
        return "row is not an object"
    prompt = row.get(prompt_field)
    if not isinstance(prompt, str) or not prompt.strip():
        return f"field {prompt_field!r} is missing or not a non-empty string"
    if row.get(answer_field) is None:
        return f"field {answer_field!r} is missing"
    return None


def valid_rows(
    path: Path, check: Callable[[Any], str | None], on_bad_row: str, report: LoadReport
) -> Iterator[tuple[int, dict]]:
    """(line, row) of every row ``check`` accepts (it returns None or the problem).

    A refused row raises :class:`DataError` with file and line (``on_bad_row="error"``)
    or is skipped and counted in ``report`` (``"skip"``); accepted rows are counted too.
    """
    for line, row in read_rows(path):
        problem = check(row)
        if problem is not None:
            where = f"{path}:{line}: {problem}"
            if on_bad_row == "error":
                raise DataError(where + " (set data.on_bad_row=skip to skip such rows)")
            report.skipped += 1
            report.first_problem = report.first_problem or where
            continue
        report.rows += 1
        yield line, row


def load_prompt_file(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    on_bad_row: str = "error",
    template: str = "{prompt}",
) -> tuple[list[Prompt], LoadReport]:
    """Read prompts from a JSONL or Parquet file. Other columns go to ``metadata``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset {str(p)!r} does not exist")
    report = LoadReport()
    prompts = []
    check = partial(_check_row, prompt_field=prompt_field, answer_field=answer_field)
    for line, row in valid_rows(p, check, on_bad_row, report):
        meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
        text = template.format(prompt=row[prompt_field])
        prompts.append(
            Prompt(text=text, answer=row[answer_field], metadata=meta, uid=f"{p.name}:{line}")
        )
    if not prompts:
        raise DataError(f"dataset {str(p)!r} has no usable rows")
    return prompts, report
