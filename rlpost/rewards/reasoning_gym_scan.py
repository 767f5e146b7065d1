"""Which reasoning-gym scorers evaluate text as code: a scan of the code a scorer reaches.

A scorer reaching ``eval``, ``exec``, ``compile`` or sympy's parsing runs only in the sandbox
(:mod:`rlpost.rewards.reasoning_gym_sandbox`). The scan follows bytecode from ``score_answer``
through reasoning-gym's functions and classes and errs on the sandbox's side; what it cannot
follow, ``tests/unit/rewards/test_reasoning_gym_safety.py`` covers with hostile answers.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from typing import Any

EVALUATING_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "breakpoint"})
"""Builtins that run text as code (a local or global of the same name shadows them)."""

EVALUATING_NAMES = frozenset({"parse_expr", "sympify", "parse_latex", "eval_expr"})
"""Function names that evaluate text whatever object they are reached through."""

EVALUATING_MODULES = ("sympy", "pandas", "pickle", "marshal", "dill", "numexpr")
"""Packages whose functions may read text as code (sympy sympifies string arguments)."""

_OWN = "reasoning_gym"
_LOADS_NAME = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_LOADS_ATTR = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _package(obj: Any) -> str:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    return (name or "").split(".")[0]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # a free variable not bound yet
        return False
    return True


def _codes(code: types.CodeType):
    """``code`` and every code object nested in it (comprehensions, lambdas, inner functions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions_of(cls: type, name: str) -> list[Any]:
    """The functions every class of ``cls``'s MRO defines under ``name`` (``super()`` calls)."""
    found = []
    for klass in cls.__mro__:
        value = klass.__dict__.get(name)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        if inspect.isfunction(value):
            found.append(value)
    return found


class _Scan:
    def __init__(self, owner: type) -> None:
        self.owner = owner
        self.found: set[str] = set()
        self.seen: set[types.CodeType] = set()
        self.todo: list[Any] = []

    def value(self, value: Any, name: str) -> None:
        """A name the code reached resolved to ``value``: flag it or follow it."""
        value = inspect.unwrap(value) if callable(value) else value
        package = _package(value) or _package(type(value))
        if package in EVALUATING_MODULES:
            self.found.add(
                f"{package}.{name}" if not isinstance(value, types.ModuleType) else package
            )
        elif package == _OWN and inspect.isclass(value):
            self.todo.extend(f for f in vars(value).values() if inspect.isfunction(f))
        elif package == _OWN and (inspect.isfunction(value) or isinstance(value, types.ModuleType)):
            self.todo.append(value)

    def function(self, fn: Any) -> None:
        if isinstance(fn, types.ModuleType):
            return  # reached only for its attributes, resolved where they are loaded
        code = getattr(fn, "__code__", None)
        if code is None or code in self.seen:
            return
        self.seen.add(code)
        scope = dict(fn.__globals__)
        cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False)
        scope.update({name: cell.cell_contents for name, cell in cells if _filled(cell)})
        for inner in _codes(code):
            modules = []
            for ins in dis.get_instructions(inner):
                name = ins.argval
                if ins.opname in _LOADS_NAME:
                    if name in scope:
                        self.value(scope[name], name)
                        if isinstance(scope[name], types.ModuleType):
                            modules.append(scope[name])
                    elif name in EVALUATING_BUILTINS:
                        self.found.add(name)
                elif ins.opname in _LOADS_ATTR:
                    if name in EVALUATING_NAMES:
                        self.found.add(name)
                    self.todo.extend(_functions_of(self.owner, name))
                    for module in modules:
                        if hasattr(module, name):
                            self.value(getattr(module, name), name)

    def run(self, start: Any) -> tuple[str, ...]:
        self.todo.append(start)
        while self.todo:
            self.function(self.todo.pop())
        return tuple(sorted(self.found))


def evaluating_calls(dataset_class: type) -> tuple[str, ...]:
    """The evaluating calls reachable from ``dataset_class.score_answer`` (empty: none found)."""
    return _Scan(dataset_class).run(dataset_class.score_answer)


@functools.cache
def task_evaluates(task: str) -> tuple[str, ...]:
    """:func:`evaluating_calls` of a reasoning-gym task's scorer, by task name."""
    from reasoning_gym.factory import DATASETS

    return evaluating_calls(DATASETS[task][0])
