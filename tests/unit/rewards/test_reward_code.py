"""code_tests: code extraction here; running tests needs the sandbox (skipped without it)."""

import pytest

from rlpost.rewards.code import code_tests, extract_code
from rlpost.types import RewardSample

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


def sample(completion: str, tests=TESTS) -> RewardSample:
    metadata = {} if tests is None else {"tests": tests}
    return RewardSample("write add", completion, metadata=metadata)


def test_extract_code_prefers_last_python_block():
    text = "```text\nnot code\n```\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"


def test_not_applicable_empty_and_bad_tests():
    assert code_tests(sample("def add(a, b): return a + b", tests=None)) is None
    assert code_tests(sample("def add(a, b): return a + b", tests=[])) is None
    assert code_tests(sample("```python\n\n```")) == 0.0  # empty program, no sandbox needed
    with pytest.raises(ValueError, match="list of assert"):
        code_tests(sample("x", tests="assert True"))


def _sandbox_or_skip():
    try:
        from rlpost.rewards.sandbox import SandboxUnavailable, run_python_tests  # noqa: F401
    except ImportError:
        pytest.skip("rlpost.rewards.sandbox.run_python_tests is not importable")
    return SandboxUnavailable


@pytest.mark.sandbox
def test_pass_fraction_and_all_pass_in_sandbox():
    unavailable = _sandbox_or_skip()
    good = sample("Here:\n```python\ndef add(a, b):\n    return a + b\n```")
    try:
        fraction = code_tests(good)
    except unavailable as exc:
        pytest.skip(f"sandbox unavailable: {exc}")
    assert fraction == pytest.approx(2 / 3)
    assert code_tests(good, all_pass=True) == 0.0
    assert (
        code_tests(
            sample("```python\ndef add(a, b):\n    return a + b\n```", TESTS[:2]), all_pass=True
        )
        == 1.0
    )
    assert code_tests(sample("```python\nimport os; os._exit(1)\n```")) == 0.0


@pytest.mark.sandbox
def test_scorer_runs_code_samples_concurrently_in_order():
    unavailable = _sandbox_or_skip()
    from rlpost.config import RewardConfig, RewardTerm
    from rlpost.rewards.scorer import build_scorer

    bodies = ["return a + b", "return a - b", "while True: pass", "return b + a"]
    batch = [sample(f"```python\ndef add(a, b):\n    {body}\n```", TESTS[:2]) for body in bodies]
    term = RewardTerm(name="code_tests", test_timeout_s=4.0)
    try:
        out = build_scorer(RewardConfig(terms=[term])).score(batch)
    except unavailable as exc:
        pytest.skip(f"sandbox unavailable: {exc}")
    assert out.scores == [1.0, 0.0, 0.0, 1.0]  # a - b fails both; the loop times out
