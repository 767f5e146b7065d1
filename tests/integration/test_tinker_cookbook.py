"""The Tinker cookbook, unmodified apart from its arguments, against ``rlpost tinker`` on
SmolLM2-135M-Instruct: ``supervised.train`` on a local JSONL of conversations lowers the
held-out NLL, and ``rl.train`` with the arithmetic environment runs its iterations (the
learning bar, +20 points in 30 minutes, is ``bench/bench_tinker.py``)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from tests.integration.test_tinker_service import start, stop
from tests.real_model import smollm2_dir

pytest.importorskip("tinker_cookbook")  # installed --no-deps (docs/tinker.md)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory, monkeypatch_module):
    model = smollm2_dir()
    proc, url = start(model, tmp_path_factory.mktemp("state"))
    monkeypatch_module.setenv("TINKER_API_KEY", "tml-cookbook")
    yield url, str(model)
    stop(proc)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _conversations(path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            messages = [{"role": "user", "content": f"What is {a}+{b}?"},
                        {"role": "assistant", "content": f"{a}+{b}={a + b}"}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")


def _metrics(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_supervised_train_lowers_held_out_nll(smol, tmp_path):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    url, model = smol
    _conversations(tmp_path / "conv.jsonl", 48, seed=0)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name="role_colon", max_length=64, batch_size=8
    )
    data = FromConversationFileBuilder(
        file_path=str(tmp_path / "conv.jsonl"), test_size=8, common_config=common
    )
    cfg = train.Config(
        log_path=str(tmp_path / "log"), model_name=model, recipe_name="sl-local",
        renderer_name="role_colon", dataset_builder=data, learning_rate=1e-3, lora_rank=8,
        base_url=url, save_every=0, eval_every=2, max_steps=5, ttl_seconds=None,
    )  # fmt: skip
    asyncio.run(train.main(cfg))
    nll = [m["test/nll"] for m in _metrics(tmp_path / "log") if "test/nll" in m]
    assert len(nll) >= 2 and nll[-1] < nll[0], nll


def test_rl_train_runs_the_arithmetic_environment(smol, tmp_path):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    url, model = smol
    data = ArithmeticDatasetBuilder(
        batch_size=2, model_name_for_tokenizer=model, renderer_name="role_colon",
        n_batches=2, group_size=4,
    )  # fmt: skip
    cfg = train.Config(
        learning_rate=1e-4, dataset_builder=data, model_name=model, recipe_name="rl-local",
        max_tokens=8, log_path=str(tmp_path / "log"), eval_every=0, save_every=0,
        renderer_name="role_colon", lora_rank=8, base_url=url, ttl_seconds=None,
    )  # fmt: skip
    asyncio.run(train.main(cfg))
    steps = [m for m in _metrics(tmp_path / "log") if "env/all/reward/total" in m]
    # the environment's reward: 1 for the right answer, less its format penalty
    rewards = [m["env/all/reward/total"] for m in steps]
    assert len(steps) == 2 and all(math.isfinite(r) and -1.0 <= r <= 1.0 for r in rewards), steps
