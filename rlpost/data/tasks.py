"""The registry of prompt tasks: a task's name -> the loader of its splits.

A new kind of source is its settings class (a ``Variant`` in rlpost.config) and one loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlpost.data.files import LoadReport
from rlpost.registry import Registry
from rlpost.types import Prompt


@dataclass
class Splits:
    """One source's rows (not yet rendered for the model) and their load reports."""

    train: list[Prompt]
    held_out: list[Prompt]
    train_report: LoadReport = field(default_factory=LoadReport)
    eval_report: LoadReport = field(default_factory=LoadReport)
    system_prompt: str | None = None  # the rows' own system message (a verifiers environment's)


Loader = Callable[..., Splits]
"""``loader(task, template=..., on_bad_row=...)``: ``task`` the variant's settings,
``template`` the source's prompt template; ValueError for bad settings, DataError for bad rows."""

TASKS: Registry[Loader] = Registry("data task")


def generated(train: list[Prompt], held_out: list[Prompt], template: str, **extra) -> Splits:
    """Splits of generated rows, each prompt through ``template``: every row is used."""
    for p in train + held_out:
        p.text = template.format(prompt=p.text)
    return Splits(
        train, held_out, LoadReport(rows=len(train)), LoadReport(rows=len(held_out)), **extra
    )
