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
                "rollout.engine.servers": json.dumps(urls),
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


def test_partial_rollout_over_http_continues_carried_samples(tmp_path, tiny_dir):
    """Remote engines are driven in token chunks; a carried sample resumes on the server."""
    proc, url = start_server(tiny_dir, "--max-tokens-limit", "64")
    try:
        over = small_overrides(
            tmp_path,
            **{
                "model.path": str(tiny_dir),
                "rollout.engine": "remote",
                "rollout.engine.servers": json.dumps([url]),
                "rollout.partial": True,
                "rollout.partial_fraction": 0.5,
                "rollout.partial_chunk_tokens": 2,
                "rollout.max_tokens": 12,
                "train.steps": 4,
                "sft.steps": 60,  # long enough to learn to stop, so lengths spread out
                "eval.every": 0,
            },
        )
        result = train(load_config(None, over))
    finally:
        stop_server(proc)
    rows = [h for h in result.history if "loss" in h]
    assert sum(r["prompts"] for r in rows) == 4 * 4  # every prompt trained exactly once
    assert any(r["carried_groups"] > 0 for r in rows[:-1]) and rows[-1]["carried_groups"] == 0
    assert max(r["sample_lag_max"] for r in rows) >= 1  # a carried sample spans versions
    for r in rows:
        assert r["logprob_gap"] < 0.5 and r["truncated_frac"] <= 1.0


def test_async_mode_against_a_server_keeps_the_bound(tmp_path, tiny_dir):
    """The overlapped loop drives remote servers too: weights stream in while they generate."""
    proc, url = start_server(tiny_dir, "--max-tokens-limit", "64")
    try:
        over = small_overrides(
            tmp_path,
            **{
                "model.path": str(tiny_dir),
                "rollout.engine": "remote",
                "rollout.engine.servers": json.dumps([url]),
                "pipeline.mode": "async",
                "pipeline.max_staleness": 2,
                "cluster.backend": "local",
                "algo.rollout_correction.name": "tis",
                "train.steps": 5,
                "sft.steps": 3,
                "eval.every": 0,
            },
        )
        result = train(load_config(None, over))
    finally:
        stop_server(proc)
    rows = [h for h in result.history if "loss" in h]
    assert len(rows) == 5 and sum(r["prompts"] for r in rows) == 5 * 4
    assert max(r["sample_lag_max"] for r in rows) <= 2
    assert max(r["sample_lag_max"] for r in rows) >= 1  # the rollout ran ahead
    assert all(0.0 < r["is_weight_mean"] for r in rows)
