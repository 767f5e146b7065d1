"""A data task from outside the package: ``n`` sums, the last ``held`` of them held out."""

from rlpost.data.tasks import Splits
from rlpost.types import Prompt


def sums(task, *, template, on_bad_row):
    rows = [Prompt(template.format(prompt=f"{i}+{i}="), 2 * i, uid=f"s{i}") for i in range(task.n)]
    return Splits(rows[: -task.held], rows[-task.held :])
