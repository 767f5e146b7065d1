"""The built-in verifiable arithmetic task.

``a+b=`` / ``a-b=`` / ``a*b=`` with operands in ``0..max_operand``, shuffled with a fixed seed,
so the held-out split is the same in every run.
"""

from __future__ import annotations

import itertools
import random

from rlpost.data.tasks import TASKS, Splits, generated
from rlpost.types import Prompt

TASK_SEED = 1234  # fixed: the split must not depend on the run seed


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def arith_problems(max_operand: int, ops: list[str]) -> list[Prompt]:
    """Every problem of the space, in the task's fixed shuffled order."""
    space = [
        (a, op, b) for op in ops for a, b in itertools.product(range(max_operand + 1), repeat=2)
    ]
    random.Random(TASK_SEED).shuffle(space)
    return [
        Prompt(
            text=f"{a}{op}{b}=",
            answer=_apply(a, op, b),
            metadata={"task": "arith"},
            uid=f"{a}{op}{b}",
        )
        for a, op, b in space
    ]


def arith_splits(
    max_operand: int, ops: list[str], train_size: int, eval_size: int
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): the first ``eval_size`` problems held out; ValueError if none is left."""
    problems = arith_problems(max_operand, ops)
    if eval_size >= len(problems):
        raise ValueError(
            f"eval_size={eval_size} leaves no training problems "
            f"(the space has {len(problems)}); raise max_operand or lower eval_size"
        )
    held_out = problems[:eval_size]
    train = problems[eval_size:]
    return train[:train_size], held_out


@TASKS.register("arith")
def load_arith(t, *, template: str, **_) -> Splits:
    return generated(*arith_splits(t.max_operand, t.ops, t.train_size, t.eval_size), template)
