"""The Tinker cookbook, unmodified apart from its arguments, against ``rlpost tinker`` on
SmolLM2-135M-Instruct: ``supervised.train`` on a local JSONL of conversations lowers the
held-out NLL, ``rl.train`` with the arithmetic environment runs its iterations (the
learning bar, +20 points in 30 minutes, is ``bench/bench_tinker.py``), and the minimal
``recipes/rl_loop.py`` / ``sl_loop.py`` run as copies that read local rows."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import sys
from pathlib import Path

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


def _local_loop(name: str, tmp_path, dataset: str, rows_path) -> object:
    """The cookbook's ``recipes/NAME.py``, copied with its hub dataset swapped for the local
    JSONL ``rows_path`` and the renderer named (a local path has no recommended one); each
    edit must match once, so a changed recipe fails here rather than running something else.
    The RL loop also logs its forward_backward metrics (the loss), which it drops."""
    import tinker_cookbook

    text = (Path(tinker_cookbook.__file__).parent / "recipes" / f"{name}.py").read_text()
    edits = {
        f"datasets.load_dataset({dataset})": (
            f"datasets.load_dataset('json', data_files={{'train': {str(rows_path)!r}}})"
        ),
        "model_info.get_recommended_renderer_name(config.model_name)": "'role_colon'",
        "_fwd_bwd_result = fwd_bwd_future.result()": (
            "_fwd_bwd_result = fwd_bwd_future.result(); metrics.update(_fwd_bwd_result.metrics)"
        ),
    }
    for old, new in edits.items():
        if old.startswith("_fwd") and name != "rl_loop":
            continue
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    path = tmp_path / f"{name}_local.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # chz resolves the Config's annotations by module
    spec.loader.exec_module(module)
    return module


def test_sl_loop_lowers_the_training_nll(smol, tmp_path):
    url, model = smol
    _conversations(tmp_path / "conv.jsonl", 12, seed=1)
    loop = _local_loop("sl_loop", tmp_path, '"HuggingFaceH4/no_robots"', tmp_path / "conv.jsonl")
    cfg = loop.Config(
        base_url=url, model_name=model, log_path=str(tmp_path / "log"), batch_size=4,
        learning_rate=1e-3, max_length=64, lora_rank=8, save_every=0, ttl_seconds=None,
    )  # fmt: skip
    loop.main(cfg)
    nll = [m["train_mean_nll"] for m in _metrics(tmp_path / "log") if "train_mean_nll" in m]
    assert len(nll) == 3 and all(map(math.isfinite, nll)) and nll[-1] < nll[0], nll


def test_rl_loop_runs_its_iterations(smol, tmp_path):
    pytest.importorskip("pylatexenc")  # the recipe's math grading (README's cookbook line)
    url, model = smol
    rng = random.Random(2)
    with open(tmp_path / "rows.jsonl", "w") as f:  # gsm8k's fields: the answer after "####"
        for _ in range(2):
            n = rng.randint(1, 9)
            f.write(
                json.dumps({"question": f"Write \\boxed{{{n}}}.", "answer": f"#### {n}"}) + "\n"
            )
    loop = _local_loop("rl_loop", tmp_path, '"openai/gsm8k", "main"', tmp_path / "rows.jsonl")
    cfg = loop.Config(
        base_url=url, model_name=model, log_path=str(tmp_path / "log"), batch_size=1,
        group_size=4, max_tokens=16, learning_rate=1e-4, lora_rank=8, save_every=0,
        loss_fn="importance_sampling", ttl_seconds=None,
    )  # fmt: skip
    loop.main(cfg)
    steps = _metrics(tmp_path / "log")
    assert len(steps) == 2 and all(math.isfinite(m["reward/total"]) for m in steps), steps
    trained = [m for m in steps if "loss:sum" in m]
    assert trained and all(math.isfinite(m["loss:sum"] + m["grad_norm"]) for m in trained), steps
