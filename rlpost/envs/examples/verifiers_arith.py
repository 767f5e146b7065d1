"""A classic verifiers environment built offline: two-operand additions, a local dataset.

Against verifiers' classic API alone: a ``vf.SingleTurnEnv`` (``tools=True``: a ``vf.ToolEnv``)
with exact-match and format rewards.

    rlpost train verifiers_arith
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def calculator(expression: str) -> str:
    """Add or subtract whole numbers: ``12+7`` or ``30-4``."""
    total, sign, digits = 0, 1, ""
    for ch in expression.replace(" ", "") + "+":
        if ch.isdigit():
            digits += ch
        elif ch in "+-" and digits:
            total, digits, sign = total + sign * int(digits), "", 1 if ch == "+" else -1
        else:
            raise ValueError(f"cannot read {expression!r}")
    return str(total)


def rows(max_operand: int, seed: int) -> list[dict]:
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def exact_match(completion, answer, parser) -> float:
    """1 when the reply's answer is the sum."""
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


async def digits_only(completion, parser) -> float:
    """1 when the reply is a number and nothing else (an async reward function)."""
    reply = (parser.parse_answer(completion) or "").strip()
    return 1.0 if reply.isdigit() else 0.0


def load_environment(
    max_operand: int = 20,
    eval_size: int = 64,
    train_size: int | None = None,
    tools: bool = False,
    format_weight: float = 0.2,
    seed: int = 0,
) -> vf.Environment:
    data = rows(max_operand, seed)
    train = data[eval_size:] if train_size is None else data[eval_size : eval_size + train_size]
    parser = vf.Parser()
    rubric = vf.Rubric(
        funcs=[exact_match, digits_only], weights=[1.0, format_weight], parser=parser
    )
    kwargs = dict(
        dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(data[:eval_size]),
        parser=parser,
        rubric=rubric,
    )
    if tools:
        return vf.ToolEnv(tools=[calculator], max_turns=3, **kwargs)
    return vf.SingleTurnEnv(**kwargs)
