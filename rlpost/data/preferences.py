"""Preference pairs: a built-in arithmetic preference task and user JSONL / Parquet files.

A pair is a prompt with a chosen and a rejected response. The built-in task
reuses the arithmetic problem space (and its fixed split, so held-out prompts
never appear in training): the chosen response is the correct result, the
rejected one is off by 1..``max_offset``. Ranking them on unseen prompts takes
some arithmetic (the magnitude of the result for a far miss, the last digit for
a near one), so the held-out accuracy measures learning, not memorisation.

User files follow ``rlpost.data.files``: a malformed row (missing field, empty
prompt, identical chosen and rejected) is skipped and counted or refused with
the file and line, as ``on_bad_row`` says. The ``data`` section of the DPO
config is defined here, next to the task it configures.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpost.config import DataConfig, prefs_task_problem
from rlpost.data.arith import TASK_SEED, arith_problems
from rlpost.data.files import DataError, LoadReport, Problem, split_off, unreadable, valid_rows


@dataclass
class PreferencePair:
    """One comparison: ``chosen`` is preferred over ``rejected`` as a reply to ``prompt``."""

    prompt: str
    chosen: str
    rejected: str
    uid: str = ""
    margin: float | None = None
    """How far the chosen reward should lead the rejected one (reward-model training's
    margin, Llama 2's); None: no margin."""


def _wrong_answers(answer: int, count: int, max_offset: int, rng: random.Random) -> list[int]:
    """``count`` distinct wrong answers within ``max_offset`` of ``answer``."""
    offsets = [d for d in range(-max_offset, max_offset + 1) if d != 0]
    return [answer + d for d in rng.sample(offsets, count)]


def preference_splits(
    max_operand: int,
    ops: list[str],
    *,
    train_size: int,
    eval_size: int,
    rejected_per_prompt: int = 2,
    max_offset: int = 20,
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train pairs, held-out pairs) of the built-in task, the same in every run.

    Held-out: one pair for each of the first ``eval_size`` problems of the
    arithmetic task's fixed order. Train: ``rejected_per_prompt`` pairs for each
    of up to ``train_size`` of the remaining problems. Rejected answers are
    drawn with a fixed task seed, never the run seed."""
    problem = prefs_task_problem(max_operand, ops, eval_size, rejected_per_prompt, max_offset)
    if problem is not None:
        raise ValueError(problem)
    problems = arith_problems(max_operand, ops)
    rng = random.Random(TASK_SEED + 1)
    held_out, train = [], []
    for i, p in enumerate(problems[: eval_size + train_size]):
        count = 1 if i < eval_size else rejected_per_prompt
        for wrong in _wrong_answers(p.answer, count, max_offset, rng):
            pair = PreferencePair(p.text, str(p.answer), str(wrong), uid=f"{p.uid}:{wrong}")
            (held_out if i < eval_size else train).append(pair)
    return train, held_out


def _check_row(
    row: Any, fields: tuple[str, str, str], margin_field: str | None = None
) -> Problem | None:
    problem = unreadable(row)
    if problem is not None:
        return problem
    if margin_field is not None:
        value = row.get(margin_field)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return "bad_margin", f"field {margin_field!r} is missing or not a finite number"
    for name in fields:
        value = row.get(name)
        if not isinstance(value, str) or not value.strip():
            return f"empty_{name}", f"field {name!r} is missing or not a non-empty string"
    if row[fields[1]] == row[fields[2]]:
        return "identical_pair", (
            f"fields {fields[1]!r} and {fields[2]!r} are identical (the pair teaches nothing)"
        )
    return None


def load_preference_file(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    on_bad_row: str = "error",
    template: str = "{prompt}",
    margin_field: str | None = None,
) -> tuple[list[PreferencePair], LoadReport]:
    """Read preference pairs from a JSONL or Parquet file; raises :class:`DataError`.

    ``margin_field``: a column of per-pair margins every row must have (a finite number)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset {str(p)!r} does not exist")
    fields = (prompt_field, chosen_field, rejected_field)
    report = LoadReport()
    pairs = []
    check = lambda row: _check_row(row, fields, margin_field)  # noqa: E731
    for line, row in valid_rows(p, check, on_bad_row, report):
        text = template.format(prompt=row[prompt_field])
        margin = None if margin_field is None else float(row[margin_field])
        uid = f"{p.name}:{line}"
        pairs.append(PreferencePair(text, row[chosen_field], row[rejected_field], uid, margin))
    if not pairs:
        raise DataError(f"dataset {str(p)!r} has no usable rows")
    return pairs, report


def load_pairs(
    d: DataConfig, seed: int
) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, int]]:
    """(train pairs, held-out pairs, load counts) as the data section says."""
    train, held_out, reports = load_pairs_reported(d, seed)
    if d.task.name == "prefs":
        return train, held_out, {}
    t, e = reports["train"], reports["eval"]
    if not d.task.eval_path:  # a train file's rows, before the held-out split
        return (
            train,
            held_out,
            {"train_rows": len(train) + len(held_out), "train_skipped": t.skipped},
        )
    counts = {"train_rows": t.rows, "train_skipped": t.skipped}
    return train, held_out, counts | {"eval_rows": e.rows, "eval_skipped": e.skipped}


def load_pairs_reported(
    d: DataConfig, seed: int, *, margin_field: str | None = None
) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, LoadReport]]:
    """(train pairs, held-out pairs, {split: LoadReport}) as the data section says; the
    reports hold every skipped row as ``file:line: problem`` (rlpost rm's data report).
    ``margin_field``: the per-pair margin column of a pairs file."""
    t = d.task
    if t.name == "prefs":
        train, held_out = preference_splits(
            t.max_operand,
            t.ops,
            train_size=t.train_size,
            eval_size=t.eval_size,
            rejected_per_prompt=t.rejected_per_prompt,
            max_offset=t.max_offset,
        )
        reports = {"train": LoadReport(rows=len(train)), "eval": LoadReport(rows=len(held_out))}
        return train, held_out, reports
    fields = dict(
        prompt_field=t.prompt_field,
        chosen_field=t.chosen_field,
        rejected_field=t.rejected_field,
        on_bad_row=d.on_bad_row,
        template=d.prompt_template,
        margin_field=margin_field,
    )
    train, report = load_preference_file(t.train_path, **fields)
    reports = {"train": report}
    if t.eval_path:
        held_out, reports["eval"] = load_preference_file(t.eval_path, **fields)
    else:
        train, held_out = split_off(train, t.eval_fraction, seed)
        report.rows = len(train)
        reports["eval"] = LoadReport(rows=len(held_out))
    return train, held_out, reports
