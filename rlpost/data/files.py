"""User datasets in JSONL or Parquet with a prompt and an answer field.

A ``.json`` file is JSON Lines too, unless it holds one array of rows (read whole; a row's
``file:N`` is then its place in the array).

A malformed row is either skipped and counted by reason or refused with the file
and line, as ``data.on_bad_row`` says; it is never used silently. Bad rows are:
bytes that are not UTF-8, a line longer than :data:`MAX_LINE_BYTES` (skipped
without being held in memory), a line that is not JSON, JSON nested deeper than
64 levels, a row that is not an object,
a missing or empty prompt, a missing or empty answer, a prompt template
naming a field the row lacks, and a column named like a key only rlpost's own
sources set (:data:`RESERVED`). (Prompts too long for the model are a reason too,
counted by :mod:`rlpost.data.render` once the tokenizer is known.)

``data.prompt_template`` is a format string over the row's fields: ``{prompt}``
is the prompt field whatever its column is called, and any other column can be
named (``"{question}\\n\\nLevel: {level}"``).
"""

from __future__ import annotations

import json
import random
import string
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from rlpost.data import safe_json
from rlpost.errors import one_line
from rlpost.types import Prompt

# A problem with a row: (reason, one-line description). The reason is what is counted.
Problem = tuple[str, str]

MAX_LINE_BYTES = 1 << 20
"""The longest JSONL line read as a row (1 MiB, newline excluded); a longer one is a bad row
(``line_too_long``), read past in pieces so that no more than this is ever held."""

_SKIP_PIECE = 1 << 16  # bytes read at a time while reading past an over-long line

RESERVED = frozenset({"reasoning_gym"})
"""Metadata keys only rlpost's own sources set: a row's other columns become its metadata,
and a row must not pick the task and entry a reasoning-gym scorer reads."""


class DataError(ValueError):
    """A dataset problem with file and line, in one line."""


@dataclass
class LoadReport:
    """Rows used and rows skipped, by reason (``skipped_by_reason``), of one file."""

    rows: int = 0
    skipped_by_reason: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    """Every skipped row as ``file:line: problem``."""
    sources: dict[str, LoadReport] = field(default_factory=dict)
    """Each data source's own report when this one sums several (data.sources)."""
    info: dict[str, Any] = field(default_factory=dict)
    """What a generated source could give (asked, unique, kept rows), for the data report."""

    @property
    def skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    @property
    def first_problem(self) -> str:
        return self.problems[0] if self.problems else ""

    def skip(self, reason: str, where: str) -> None:
        self.skipped_by_reason[reason] += 1
        self.problems.append(where)

    def add(self, name: str, other: LoadReport) -> None:
        """Count ``other`` (data source ``name``'s report) in this sum, and keep it by name."""
        self.rows += other.rows
        self.skipped_by_reason.update(other.skipped_by_reason)
        self.problems.extend(other.problems)
        self.sources[name] = other

    def counts(self, prefix: str) -> dict[str, int]:
        """``{prefix}_rows``, ``{prefix}_skipped`` and ``{prefix}_skipped_{reason}``."""
        out = {f"{prefix}_rows": self.rows, f"{prefix}_skipped": self.skipped}
        out.update({f"{prefix}_skipped_{r}": n for r, n in sorted(self.skipped_by_reason.items())})
        return out


class _NotUTF8(Exception):
    def __init__(self, exc: UnicodeDecodeError) -> None:
        super().__init__(f"byte 0x{exc.object[exc.start]:02x} at column {exc.start + 1}")


class _TooLong(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(f"line is {size:,} bytes; a row holds at most {MAX_LINE_BYTES:,}")


BLANK = object()
"""What :func:`decode_line` gives for a blank line (not a row)."""


def decode_line(raw: bytes) -> Any:
    """One JSONL line's row, :data:`BLANK`, or the exception that kept it from being read."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _NotUTF8(exc)
    if not line.strip():
        return BLANK
    try:
        return safe_json.loads(line)
    except (json.JSONDecodeError, safe_json.TooDeep) as exc:
        return exc


def jsonl_rows(f: BinaryIO) -> Iterator[tuple[int, Any]]:
    """(line, row) of every non-blank line of a JSONL file open in binary mode, read line by
    line; a row that cannot be read is an exception in place (a line over
    :data:`MAX_LINE_BYTES` too, read past without holding it)."""
    line = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        line += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            yield line, _TooLong(_read_past_line(f, len(raw)))
            continue
        row = decode_line(raw)
        if row is not BLANK:
            yield line, row


def _read_past_line(f: BinaryIO, size: int) -> int:
    """Read the rest of a line a piece at a time; the line's length (``size`` bytes read)."""
    while piece := f.readline(_SKIP_PIECE):
        if piece.endswith(b"\n"):
            return size + len(piece) - 1
        size += len(piece)
    return size


def read_rows(path: Path) -> list[tuple[int, Any]]:
    """(line, row) of every non-blank row; a row that cannot be read is an exception in place."""
    if is_json_array(path):
        return array_rows(path)
    if path.suffix in (".jsonl", ".json"):
        with path.open("rb") as f:
            return list(jsonl_rows(f))
    if path.is_dir():  # a ``datasets`` save_to_disk directory
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: a dataset directory needs pip install datasets") from None
        try:
            table = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises its own types for a directory it cannot read
            raise DataError(f"{path}: cannot read a save_to_disk directory ({exc})") from None
        if isinstance(table, datasets.DatasetDict):
            raise DataError(
                f"{path}: holds splits {sorted(table)}; name one split's directory "
                f"({path}/{sorted(table)[0]})"
            )
        return [(i, row) for i, row in enumerate(table, start=1)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises many types for a corrupt file
            raise DataError(f"{path}: cannot read Parquet ({exc})") from None
        return [(i, row) for i, row in enumerate(table.to_pylist(), start=1)]
    raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")


def is_json_array(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file holding one JSON array (else it is JSON Lines,
    as ``datasets``' ``to_json`` writes)."""
    if path.suffix != ".json" or not path.is_file():
        return False
    with path.open("rb") as f:
        while piece := f.read(4096):
            if head := piece.lstrip():
                return head.startswith(b"[")
    return False


def array_rows(path: Path) -> list[tuple[int, Any]]:
    """(element number, row) of a ``.json`` file holding one array, read whole."""
    try:  # the array is one level above its rows, which get the rows' bound
        rows = safe_json.loads(path.read_bytes(), safe_json.MAX_DEPTH + 1)
    except ValueError as exc:  # JSONDecodeError, TooDeep, UnicodeDecodeError
        raise DataError(f"{path}: not a readable JSON array ({one_line(exc)})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: holds one JSON value that is not an array; write one row a line")
    return list(enumerate(rows, start=1))


def unreadable(row: Any) -> Problem | None:
    """The problem of a row that is not a JSON object, or None."""
    if isinstance(row, _NotUTF8):
        return "not_utf8", f"not UTF-8 ({row})"
    if isinstance(row, _TooLong):
        return "line_too_long", str(row)
    if isinstance(row, json.JSONDecodeError):
        return "invalid_json", f"not valid JSON ({row.msg})"
    if isinstance(row, safe_json.TooDeep):
        return "too_deep", f"JSON {row}"
    if not isinstance(row, dict):
        return "not_object", "row is not an object"
    return None


def template_fields(template: str) -> set[str]:
    """Field names a format string uses (``{a.b}`` and ``{a[0]}`` name ``a``); ValueError if malformed."""
    names = set()
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None:
            names.add(name.split(".")[0].split("[")[0])
    return names


def check_row(row: Any, prompt_field: str, answer_field: str, template: str) -> Problem | None:
    """The problem of one row of a prompt file (or stream), or None."""
    problem = unreadable(row)
    if problem is not None:
        return problem
    prompt = row.get(prompt_field)
    if not isinstance(prompt, str) or not prompt.strip():
        return "empty_prompt", f"field {prompt_field!r} is missing or not a non-empty string"
    answer = row.get(answer_field)
    if answer is None:
        return "missing_answer", f"field {answer_field!r} is missing"
    if isinstance(answer, str) and not answer.strip():
        return "empty_answer", f"field {answer_field!r} is empty"
    reserved = sorted(RESERVED.intersection(row) - {prompt_field, answer_field})
    if reserved:
        return "reserved_field", (
            f"column {reserved[0]!r} is reserved for rows rlpost generates (a task: "
            f"{reserved[0]} source); rename the column"
        )
    missing = sorted(template_fields(template) - set(row) - {"prompt"})
    if missing:
        return "template_field", (
            f"data.prompt_template names field {missing[0]!r}, which this row lacks "
            f"(its fields: {', '.join(sorted(row))})"
        )
    try:  # a format spec the row's value does not take ({level:d} on a string)
        template.format(**{**row, "prompt": prompt})
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as exc:
        line = one_line(exc)
        if isinstance(exc, KeyError):
            line = f"it names field {exc.args[0]!r}, which this row lacks"
        return "template_error", f"data.prompt_template cannot format this row ({line})"
    return None


def refuse_or_skip(where: str, problem: Problem, on_bad_row: str, report: LoadReport) -> None:
    """Raise :class:`DataError` for ``on_bad_row="error"``, else count the skip."""
    if on_bad_row == "error":
        raise DataError(f"{where}: {problem[1]} (set data.on_bad_row=skip to skip such rows)")
    report.skip(problem[0], f"{where}: {problem[1]} [{problem[0]}]")


def valid_rows(
    path: Path,
    check: Callable[[Any], Problem | None],
    on_bad_row: str,
    report: LoadReport,
    rows: Iterable[tuple[int, Any]] | None = None,
) -> Iterator[tuple[int, dict]]:
    """(line, row) of every row ``check`` accepts (it returns None or the problem), of the
    file or of ``rows`` read from it (a stream's chunk).

    A refused row raises :class:`DataError` with file and line (``on_bad_row="error"``)
    or is skipped and counted by reason in ``report`` (``"skip"``); accepted rows are
    counted too."""
    for line, row in read_rows(path) if rows is None else rows:
        problem = check(row)
        if problem is not None:
            refuse_or_skip(f"{path}:{line}", problem, on_bad_row, report)
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
    """Read prompts from a JSONL or Parquet file. Other columns go to ``metadata``.

    ``uid`` is ``file:line``, so a later problem with the prompt can name its row."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset {str(p)!r} does not exist")
    report = LoadReport()
    prompts = []
    check = partial(
        check_row, prompt_field=prompt_field, answer_field=answer_field, template=template
    )
    for line, row in valid_rows(p, check, on_bad_row, report):
        prompts.append(row_prompt(row, f"{p.name}:{line}", prompt_field, answer_field, template))
    if not prompts:
        raise DataError(f"dataset {str(p)!r} has no usable rows ({report.first_problem})")
    return prompts, report


def prompt_file_keywords(task, on_bad_row: str, template: str) -> dict:
    """The keywords of :func:`load_prompt_file` (and a stream's reader): a file task's
    fields, ``on_bad_row`` and the source's template."""
    return dict(
        prompt_field=task.prompt_field,
        answer_field=task.answer_field,
        on_bad_row=on_bad_row,
        template=template,
    )


def row_prompt(row: dict, uid: str, prompt_field: str, answer_field: str, template: str) -> Prompt:
    """The prompt of a row that passed the checks; other columns go to ``metadata``."""
    meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
    text = template.format(**{**row, "prompt": row[prompt_field]})
    return Prompt(text=text, answer=row[answer_field], metadata=meta, uid=uid)


def split_off(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held_out): a seeded ``fraction`` of ``rows`` held out (at least one, never all),
    each part in the rows' order."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(fraction * len(rows))), len(rows) - 1)
    if n_eval < 1:
        raise DataError("a held-out split needs at least two rows; set data.task.eval_path instead")
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [
        r for i, r in enumerate(rows) if i in held
    ]
