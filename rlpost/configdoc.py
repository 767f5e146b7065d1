"""Config tables in the docs, generated from the config classes so they cannot drift.

A Markdown file marks a generated table with ``<!-- config-table: SECTION -->`` and
``<!-- end config-table -->``; ``python -m rlpost.configdoc FILE...`` rewrites what is
between the markers from the field defaults and docstrings of that config section,
and a test checks that the committed docs equal what it would write.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from rlpost.config import Config, choices, section_class
from rlpost.params import Variant

_BLOCK = re.compile(
    r"(<!-- config-table: (?P<section>[\w.]+) -->\n)(?P<body>.*?)(<!-- end config-table -->)",
    re.DOTALL,
)


def section_model(section: str) -> type[BaseModel]:
    """The class of a config section; ``algo.loss.dapo`` is the variant dapo of the choice
    algo.loss."""
    choice, _, name = section.rpartition(".")
    if choice in choices():
        return choices()[choice][0][name]
    model: Any = Config
    for part in section.split("."):
        ann = model.model_fields[part].annotation
        model = section_class(ann) or get_args(ann)[0]  # a list of sections: its item's table
    return model


def markdown_table(section: str) -> str:
    """``| key | default | meaning |`` rows for every field of the config ``section``."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for name, field in section_model(section).model_fields.items():
        if name == "name" and "." in section and isinstance(field.default, str):
            continue  # a variant's name is its table's title
        if field.is_required():
            rows.append(f"| `{name}` | required | {_meaning(field)} |")
            continue
        value = field.get_default(call_default_factory=True)
        if isinstance(value, Variant):  # a choice: its default's name (its keys: their table)
            value = value.name
        nested = isinstance(value, BaseModel)  # a nested section: its keys on one line
        value = value.model_dump() if nested else value
        default = yaml.safe_dump(value, default_flow_style=nested, width=1 << 16).strip()
        default = default.removesuffix("\n...").strip()
        rows.append(f"| `{name}` | `{default}` | {_meaning(field)} |")
    return "\n".join(rows) + "\n"


def _meaning(field) -> str:
    return " ".join((field.description or "").split()).replace("|", "\\|")


def render(text: str) -> str:
    """``text`` with every marked config table regenerated."""
    return _BLOCK.sub(lambda m: m.group(1) + markdown_table(m["section"]) + m.group(4), text)


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        text = path.read_text()
        if render(text) != text:
            path.write_text(render(text))
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
