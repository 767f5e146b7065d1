"""reasoning-gym tasks as a data source (extra ``[reasoning_gym]``).

Rows are generated once at load from a fixed seed and de-duplicated by question; the first
``eval_size`` unique ones are held out, the next ``train_size`` train. Each prompt keeps the
entry in memory as a :class:`TaskEntry` in ``metadata["reasoning_gym"]``, which no file or
dataset row can hold, so a row never picks what a scorer reads (some scorers break once an
entry went through JSON). Tasks whose order depends on the string hash are drawn in a child
with ``PYTHONHASHSEED=0``; tasks whose scorer is broken are refused (:data:`BROKEN`).
"""

from __future__ import annotations

import difflib
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from rlpost.config import ReasoningGymConfig
from rlpost.data.files import LoadReport
from rlpost.data.tasks import TASKS, Splits
from rlpost.types import Prompt

BROKEN: dict[str, str] = {
    "game_of_life_halting": "its scorer gives 1.0 to any non-empty answer",
    "composite": "it mixes other tasks; list those tasks as sources of their own",
}
"""Tasks refused at load, with the reason."""

HASH_SEEDED = frozenset(
    {
        "isomorphic_strings",
        "knight_swap",
        "list_functions",
        "polynomial_multiplication",
        "ransom_note",
        "word_ladder",
    }
)
"""Tasks whose rows depend on Python's string hash (seen with PYTHONHASHSEED=1 and 2)."""


@dataclass(frozen=True)
class TaskEntry:
    """One row this source generated: its task, the task's settings and the entry."""

    task: str
    config: dict[str, Any]
    entry: dict[str, Any]
    evaluate_answers: bool = False


STALL_DRAWS = 200
"""Draws in a row without a new question after which the task's space is taken as spent."""


CHILD_TIMEOUT_S = 600.0
"""How long the child that generates a :data:`HASH_SEEDED` task's rows may take."""


def _import():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            "task=reasoning_gym needs the reasoning-gym package: pip install 'rlpost[reasoning_gym]'"
        ) from None
    return reasoning_gym


def task_problem(c: ReasoningGymConfig) -> str | None:
    """Why this source cannot generate rows (one phrase with its fix), or None."""
    try:
        rg = _import()
    except ValueError as exc:
        return str(exc)
    from reasoning_gym.factory import DATASETS

    if not c.task:
        return "no task named; name one in task (e.g. basic_arithmetic)"
    if c.task not in DATASETS:
        near = difflib.get_close_matches(c.task, list(DATASETS), n=3)
        fix = f"did you mean {', '.join(near)}" if near else "see reasoning_gym.factory.DATASETS"
        return f"reasoning-gym has no task {c.task!r}; {fix}"
    if c.task in BROKEN:
        return f"refused: {BROKEN[c.task]}"
    reserved = sorted({"seed", "size"} & set(c.config))
    if reserved:
        return f"config.{reserved[0]} is set by the source; set {reserved[0]} beside config"
    try:
        rg.create_dataset(c.task, seed=c.seed, size=1, **c.config)
    except (TypeError, ValueError, AssertionError) as exc:  # the task's own config checks
        return f"task {c.task} refuses config {c.config} ({type(exc).__name__}: {exc})"
    return None


def draw(task: str, config: dict[str, Any], seed: int, wanted: int, max_draws: int) -> tuple:
    """(unique entries with their draw index, draws made): up to ``wanted`` in ``max_draws``,
    stopping after :data:`STALL_DRAWS` draws bring nothing new."""
    rg = _import()
    dataset = rg.create_dataset(task, seed=seed, size=max_draws, **config)
    seen: set[str] = set()
    out: list[tuple[int, dict]] = []
    stall = i = 0
    for i in range(max_draws):
        entry = dataset[i]
        if entry["question"] in seen:
            stall += 1
            if stall >= STALL_DRAWS:
                break
            continue
        stall = 0
        seen.add(entry["question"])
        out.append((i, entry))
        if len(out) >= wanted:
            break
    return out, i + 1


def _draw_fixed_hash(*args, timeout: float = CHILD_TIMEOUT_S) -> tuple:
    """:func:`draw` in a child process whose string hash is fixed (:data:`HASH_SEEDED`); ``-P``
    keeps the working directory off its path (``-I`` would drop ``PYTHONHASHSEED``)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    code = (
        "import pickle, sys; from rlpost.data.reasoning_gym import draw; "
        "sys.stdout.buffer.write(pickle.dumps(draw(*pickle.loads(sys.stdin.buffer.read()))))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-c", code],
            input=pickle.dumps(args),
            capture_output=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"task={args[0]}: generating {args[3]} rows in a child process took "
            f"over {timeout:g} s; lower train_size and eval_size or narrow its config"
        ) from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise ValueError(f"generating {args[0]} in a child process failed ({''.join(tail)})")
    return pickle.loads(done.stdout)  # our own child's output, written just above


def generate_splits(
    c: ReasoningGymConfig, template: str
) -> tuple[list[Prompt], list[Prompt], dict[str, Any]]:
    """(train prompts, held-out prompts, what the generation gave) of one source."""
    problem = task_problem(c)
    if problem is not None:
        raise ValueError(f"task={c.task}: {problem}")
    asked = c.train_size + c.eval_size
    args = (c.task, dict(c.config), c.seed, asked, 4 * asked + STALL_DRAWS)
    fixed = os.environ.get("PYTHONHASHSEED") == "0"  # the child's, so every start agrees
    entries, draws = draw(*args) if fixed or c.task not in HASH_SEEDED else _draw_fixed_hash(*args)
    if len(entries) <= c.eval_size:
        raise ValueError(
            f"eval_size={c.eval_size}: task {c.task} gave {len(entries)} unique "
            f"questions in {draws} draws, none left to train on; lower eval_size or widen its config"
        )
    prompts = [
        Prompt(
            text=template.format(prompt=e["question"]),
            answer=e.get("answer"),
            metadata={"reasoning_gym": TaskEntry(c.task, dict(c.config), e, c.evaluate_answers)},
            uid=f"{c.task}:{i}",
        )
        for i, e in entries
    ]
    info = {
        "task": c.task,
        "asked": asked,
        "draws": draws,
        "unique": len(entries),
        "short": max(0, asked - len(entries)),
    }
    return prompts[c.eval_size :], prompts[: c.eval_size], info


@TASKS.register("reasoning_gym")
def load_task(c: ReasoningGymConfig, *, template: str, **_) -> Splits:
    train, held_out, info = generate_splits(c, template)
    return Splits(
        train, held_out, LoadReport(rows=len(train), info=info), LoadReport(rows=len(held_out))
    )
