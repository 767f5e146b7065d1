"""Every registered reward against hostile answers: a finite score or None, and no effect.

Each reward (parametrized over both registries, so a new one is covered the day it is
registered) scores answers a policy can write: code that would write a file, change
the environment or set a flag if anything evaluated it; megabytes of text; brackets
10,000 deep; NaN and infinity spelled out; right-to-left marks, fullwidth digits,
zero-width characters, a lone surrogate, NUL; nothing at all. Each answer comes bare,
in ``<answer>`` tags, in ``\\boxed{}`` and in a Python fence. The reward must return
None or finite floats, raise nothing, and leave no file, environment variable or flag
behind. A guard alarm fails a reward that never returns (no timing is asserted).
"""

from __future__ import annotations

import builtins
import json
import math
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlpost.rewards.catalog import lookup
from rlpost.rewards.registry import REWARDS, SCORERS
from rlpost.types import RewardSample

FLAG = "RLPOST_HOSTILE_FLAG"
ENV = "RLPOST_HOSTILE_ENV"
HANG_GUARD_S = 600  # a reward that never returns fails instead of wedging the suite

EXCLUDED = {
    "reward_model": "scores token ids with a trained checkpoint: text is never parsed as "
    "code, and building one costs a model load; covered by tests/integration/test_reward_model.py",
}


def _answers(mark: str) -> dict[str, str]:
    effect = (
        f"__import__('builtins').__dict__.__setitem__('{FLAG}', 1) or "
        f"__import__('os').environ.__setitem__('{ENV}', '1') or "
        f"open({mark!r}, 'w').close() or 'x'"
    )
    return {
        "code": effect,
        "code_list": f"[{effect}]",
        "code_statement": f"import os; os.system('touch {mark}')",
        "code_latex": f"$\\text{{{effect}}}$ = {effect}",
        "digits_mb": "9" * 2_000_000,
        "text_mb": "ab cd\n" * 400_000,
        "brackets_deep": "[" * 10_000 + "]" * 10_000,
        "parens_deep": "(" * 10_000 + "1" + ")" * 10_000,
        "braces_deep": "\\frac{" * 10_000 + "1" + "}" * 10_000,
        "nan": "NaN",
        "inf": "inf",
        "neg_inf": "-Infinity",
        "huge_float": "1e999",
        "rtl": "\u202e22\u202c",
        "fullwidth": "\uff12\uff12",
        "zero_width": "2\u200b2\ufeff",
        "surrogate": "2\ud8002",
        "nul": "2\x002",
        "empty": "",
        "blank": " \n\t ",
    }


def _wrap(answer: str) -> list[str]:
    return [
        answer,
        f"<answer>{answer}</answer>",
        f"\\boxed{{{answer}}}",
        f"```python\n{answer}\n```",
    ]


class _Judge(BaseHTTPRequestHandler):
    """A real local judge: reads the request and answers every one with a fixed verdict."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"choices": [{"message": {"content": "Score: 5"}, "text": "Score: 5"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _params(name: str, judge_url: str) -> dict:
    if name == "judge":
        return {"base_url": judge_url, "model": "m", "retries": 0}
    if name == "verifiers_rubric":
        pytest.importorskip("verifiers")
        return {"rubric": "tests.integration.verifiers_envs:arith_rubric"}
    if name == "code_tests":
        return {"sandbox": {"timeout_s": 2.0}}
    return {}


def _metadata(name: str) -> list[dict]:
    """Metadata that makes the reward applicable (one dict per prompt it is tried on)."""
    if name != "reasoning_gym":
        return [{"numbers": [2, 11], "target": 22, "tests": ["assert True"]}]
    pytest.importorskip("reasoning_gym")
    from rlpost.config import ReasoningGymConfig
    from rlpost.data.reasoning_gym import generate_splits
    from rlpost.rewards.reasoning_gym_sandbox import sandbox_problem

    tasks = ["basic_arithmetic"] + (["string_insertion"] if sandbox_problem() is None else [])
    configs = [
        ReasoningGymConfig(task=t, train_size=1, eval_size=1, evaluate_answers=True) for t in tasks
    ]
    return [generate_splits(c, "{prompt}")[0][0].metadata for c in configs]


def _samples(name: str, mark: str) -> list[RewardSample]:
    return [
        RewardSample("Make 22.", text, "22", meta, "length", len(text) // 4, 4096)
        for meta in _metadata(name)
        for answer in _answers(mark).values()
        for text in _wrap(answer)
    ]


def _score(name: str, params: dict, samples: list[RewardSample]) -> list:
    kind, obj = lookup(name)
    if kind == "sample":
        return [obj(s, **params) for s in samples]
    scorer = obj(**params)
    try:
        return list(scorer.score(samples))
    finally:
        getattr(scorer, "close", lambda: None)()


def _on_hang(signum, frame):
    raise TimeoutError(f"a reward did not return in {HANG_GUARD_S} s")


@pytest.mark.parametrize("name", sorted([*REWARDS.names(), *SCORERS.names()]))
def test_hostile_answers_score_finite_or_none_and_change_nothing(name, tmp_path, judge_url):
    if name in EXCLUDED:
        pytest.skip(EXCLUDED[name])
    mark = str(tmp_path / "evaluated")
    samples = _samples(name, mark)
    environ = dict(os.environ)
    previous = signal.signal(signal.SIGALRM, _on_hang)
    signal.alarm(HANG_GUARD_S)
    try:
        values = _score(name, _params(name, judge_url), samples)
    except Exception as exc:
        if type(exc).__name__ == "SandboxUnavailable" and name == "code_tests":
            pytest.skip(f"{name}: sandbox not available ({exc})")
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(values) == len(samples)
    bad = [v for v in values if not (v is None or (isinstance(v, float) and math.isfinite(v)))]
    assert bad == []
    assert not os.path.exists(mark) and os.listdir(tmp_path) == []
    assert builtins.__dict__.pop(FLAG, None) is None
    assert dict(os.environ) == environ
