"""A built-in code task: write a one-line Python function that passes given asserts.

``f(x)=3*x+1:``, scored by ``code_tests``; shuffled with a fixed seed.
"""

from __future__ import annotations

import random

from rlpost.data.tasks import TASKS, Splits, generated
from rlpost.types import Prompt

TASK_SEED = 4321
FORMS = ("{a}*x+{b}", "{a}*x-{b}", "x*x+{b}", "{a}*(x+{b})")


def code_problems() -> list[Prompt]:
    """Every problem, in the task's fixed shuffled order."""
    exprs = sorted(
        {form.format(a=a, b=b) for form in FORMS for a in range(1, 10) for b in range(10)}
    )
    random.Random(TASK_SEED).shuffle(exprs)
    out = []
    for expr in exprs:
        fn = eval(f"lambda x: {expr}")
        tests = [f"assert f({x}) == {fn(x)}" for x in (0, 1, 2, 5)]
        out.append(
            Prompt(
                text=f"f(x)={expr}:",
                answer=f"def f(x): return {expr}",
                metadata={"task": "code", "tests": tests},
                uid=expr,
            )
        )
    return out


def code_splits(train_size: int, eval_size: int) -> tuple[list[Prompt], list[Prompt]]:
    problems = code_problems()
    if eval_size >= len(problems):
        raise ValueError(
            f"eval_size={eval_size} leaves no training problems (the space has {len(problems)})"
        )
    return problems[eval_size:][:train_size], problems[:eval_size]


@TASKS.register("code")
def load_code(t, *, template: str, **_) -> Splits:
    return generated(*code_splits(t.train_size, t.eval_size), template)
