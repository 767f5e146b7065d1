"""The training loop with rollout.engine=remote against two real rollout servers."""

import json

from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides
from tests.integration.test_server import start_server, stop_server


def test_grpo_steps_through_two_servers(tmp_path, tiny_dir):
    procs, urls = [], []
    try:
        for _ in range(2):
            proc, url = start_server(tiny_dir, "--max-tokens-limit", "64")
            procs.append(proc)
            urls.append(url)
        over = small_overrides(
            tmp_path,
            **{
                "model.path": str(tiny_dir),
                "rollout.engine": "remote",
                "rollout.servers": json.dumps(urls),
                "train.steps": 3,
                "sft.steps": 3,
            },
        )
        result = train(load_config(None, over))
    finally:
        for proc in procs:
            stop_server(proc)
    rows = [h for h in result.history if "loss" in h]
    assert [r["policy_version"] for r in rows] == [
        0,
        1,
        2,
    ]  # each batch sampled by the newest weights
    for r in rows:
        assert r["logprob_gap"] < 1e-3  # the servers serve exactly the trainer's weights
        assert r["prompts"] == 4
    assert result.summary["eval_accuracy_end"] is not None
