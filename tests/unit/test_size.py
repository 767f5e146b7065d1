"""The size of rlpost, reported and bounded: a feature pays for its schema in review.

Numbers, each with a bound in ``SIZE_BOUNDS``: the code under ``rlpost/`` counted as ``ast``
sees it, so packing cannot game it (statements, and code characters: every token but
comments, docstrings and whitespace, :func:`code_size`), its raw lines (the unit a round's
budget is stated in), keys ``rlpost config grpo_arith --keys`` lists, functions longer than 60
lines, blocks of ``BLOCK`` lines (stripped, blank lines and comments left out) written twice,
and the modules whose functions one GRPO step of the default recipe calls
(:func:`step_modules`). A change that
raises one past its bound fails here with the number; lower the bound when a change shrinks
it, so the slack does not come back unseen, and raise it only by what a feature's commit
adds and names. Run ``python tests/unit/test_size.py`` to print them.
"""

from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rlpost"
BLOCK = 8
LONG_FUNCTION = 60
SIZE_BOUNDS = {
    "statements": 20_923,
    "code_chars": 900_513,
    "lines": 38_000,
    "grpo_arith_keys": 134,
    "functions_over_60_lines": 5,
    "repeated_blocks": 2,
    "grpo_step_modules": 24,
}
"""The bounds; each number may only fall."""


def sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def code_size(text: str) -> tuple[int, int]:
    """(statements, code characters) of one module. Statements are ``ast.stmt`` nodes but
    docstrings, so ``a = 1; b = 2`` is two whatever the lines; code characters are the characters of every
    token but comments, docstrings (a string that is a statement of its own) and the
    whitespace, indentation, line breaks and semicolons between tokens."""
    tree = ast.parse(text)
    docstrings = {
        (node.lineno, node.col_offset)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    chars = sum(
        len(tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type not in skip
        and tok.string != ";"
        and not (tok.type == tokenize.STRING and tok.start in docstrings)
    )
    return sum(isinstance(n, ast.stmt) for n in ast.walk(tree)) - len(docstrings), chars


def code_sizes(files: dict[Path, str]) -> tuple[int, int]:
    sizes = [code_size(text) for text in files.values()]
    return sum(s for s, _ in sizes), sum(c for _, c in sizes)


def long_functions(files: dict[Path, str]) -> list[str]:
    out = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTION:
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    return out


def repeated_blocks(files: dict[Path, str]) -> list[str]:
    """Places where ``BLOCK`` consecutive code lines also appear elsewhere (one per block)."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path, text in files.items():
        lines = [
            (i + 1, ln.strip())
            for i, ln in enumerate(text.splitlines())
            if ln.strip() and not ln.strip().startswith(("#", "import ", "from "))
        ]
        for k in range(len(lines) - BLOCK + 1):
            window = [ln for _, ln in lines[k : k + BLOCK]]
            if sum(len(ln) > 3 for ln in window) < BLOCK - 1:  # brackets and `)` lines alone
                continue
            digest = hashlib.sha1("\n".join(window).encode()).hexdigest()
            seen[digest].append(f"{path.relative_to(PACKAGE.parent)}:{lines[k][0]}")
    repeated, last = [], {}
    for places in seen.values():
        if len(places) > 1:
            # overlapping windows of one long repeat count once: skip a window that continues
            # the previous one in every place
            key = tuple(p.rsplit(":", 1)[0] for p in places)
            starts = tuple(int(p.rsplit(":", 1)[1]) for p in places)
            prev = last.get(key)
            last[key] = starts
            if prev is not None and all(
                0 < s - q <= BLOCK for s, q in zip(starts, prev, strict=True)
            ):
                continue
            repeated.append(" = ".join(places))
    return repeated


def grpo_arith_keys() -> int:
    from rlpost.cli import config_keys
    from rlpost.config import RECIPES_DIR, load_config

    return len(config_keys(load_config(RECIPES_DIR / "grpo_arith.yaml")))


def step_modules() -> list[str]:
    """The modules whose functions a steady GRPO step of the default recipe calls, from the
    start of its second step to its first optimizer step (rollout, reward, advantages, the
    losses and the backward), traced in this process on the built-in tiny model."""
    import sys
    import tempfile
    import threading

    from rlpost.config import load_config
    from rlpost.pipeline import loop
    from rlpost.train import optim

    seen, steps = set(), []

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            seen.add(frame.f_code.co_filename)

    def set_trace(fn) -> None:
        sys.setprofile(fn)
        threading.setprofile(fn)

    def rl_step(r, step):
        steps.append(step)
        if len(steps) == 2:
            set_trace(trace)
        return plain_rl_step(r, step)

    def step(self, *args, **kwargs):
        set_trace(None)
        return plain_step(self, *args, **kwargs)

    plain_rl_step, plain_step = loop.rl_step, optim.SlicedAdamW.step
    loop.rl_step, optim.SlicedAdamW.step = rl_step, step
    try:
        with tempfile.TemporaryDirectory() as out:
            over = ["sft.steps=0", "train.steps=2", "eval.every=0", "eval.limit=4"]
            over += [f"run.output_dir={out}", "observe.progress=false", "observe.plot=false"]
            loop.train(load_config(None, over))
    finally:
        set_trace(None)
        loop.rl_step, optim.SlicedAdamW.step = plain_rl_step, plain_step
    return sorted(str(Path(f).relative_to(PACKAGE.parent)) for f in seen)


MEASURES = {
    "statements": lambda: code_sizes(sources())[0],
    "code_chars": lambda: code_sizes(sources())[1],
    "lines": lambda: sum(len(t.splitlines()) for t in sources().values()),
    "grpo_arith_keys": grpo_arith_keys,
    "functions_over_60_lines": lambda: len(long_functions(sources())),
    "repeated_blocks": lambda: len(repeated_blocks(sources())),
    "grpo_step_modules": lambda: len(step_modules()),
}


@pytest.mark.parametrize("name", sorted(SIZE_BOUNDS))
def test_size_within_bound(name):
    got = MEASURES[name]()
    assert got <= SIZE_BOUNDS[name], (
        f"{name} is {got}, over its bound {SIZE_BOUNDS[name]}: make the new part pay for its "
        "place (python tests/unit/test_size.py lists the places)"
    )


def test_the_counters_see_what_they_count(tmp_path):
    body = "\n".join(f"    total = total + {i}  # step" for i in range(70))
    twice = "\n".join(f"value_{i} = compute(value_{i - 1}, {i})" for i in range(1, 10))
    files = {
        PACKAGE / "a.py": f"def long(total):\n{body}\n    return total\n\n{twice}\n",
        PACKAGE / "b.py": f"def short():\n    return 1\n\n{twice}\n",
    }
    assert long_functions(files) == ["rlpost/a.py:1 long"]
    assert len(repeated_blocks(files)) == 1


def test_code_is_counted_whatever_its_packing():
    loose = '''def f(a, b):
    """Add two numbers.

    A docstring is not code.
    """
    # nor is a comment
    total = a + b

    return total
'''
    packed = "def f(a, b):\n    total = a + b; return total  # fmt: skip\n"
    assert code_size(loose) == code_size(packed) == (3, len("deff(a,b):total=a+breturntotal"))
    assert code_size(packed.replace("total = a + b; ", ""))[0] == 2  # and a statement less shows


if __name__ == "__main__":
    files = sources()
    print("\n".join(long_functions(files)))
    print("\n".join(repeated_blocks(files)))
    print("\n".join(step_modules()))
    for k, measured in MEASURES.items():
        print(f"{k}: {measured()} (bound {SIZE_BOUNDS[k]})")
