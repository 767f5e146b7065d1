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
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from rlpost.config import Config, section_class
from rlpost.params import Variant

_BLOCK = re.compile(
    r"(<!-- config-table: (?P<section>[\w.]+) -->\n)(?P<body>.*?)(<!-- end config-table -->)",
    re.DOTALL,
)


def section_model(section: str) -> type[BaseModel]:
    """The class of a config section; ``algo.loss.dapo`` is the variant dapo of the choice
    algo.loss."""
    model: Any = Config
    for part in section.split("."):
        if isinstance(model, dict):  # a choice: the part names its variant
            model = model[part]
            continue
        model = (
            section_class(model.model_fields[part].annotation)
            or model.model_fields[part].annotation
        )
        if get_origin(model) is list:  # a list of sections (data.sources): its item's table
            model = get_args(model)[0]
        elif get_origin(model) is Union:  # a choice: its variants by name
            model = {a.__metadata__[0].tag: a.__origin__ for a in get_args(model)}
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
