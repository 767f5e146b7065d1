"""``rlpost train sync.channel=gloo``: the run's weight path (rank 0, in the loop's process)
sends every version over torch.distributed to the rollout worker in its own process (rank 1),
and ``sync_bytes`` counts what crossed the wire as for every channel (CPU, spawned)."""

from __future__ import annotations

import json

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.pipeline import rules
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides

STEPS = 2


def _run(tmp_path, channel: str) -> list[dict]:
    """The step rows of a short run with a process-backend rollout worker over ``channel``."""
    over = small_overrides(
        tmp_path / channel,
        **{
            "cluster.backend": "process",
            "sync.channel": channel,
            "sync.codec": "bf16",
            "train.steps": STEPS,
            "sft.steps": 0,
            "eval.every": 0,
            "eval.limit": 4,
            "checkpoint.every": 0,
            "algo.entropy_coef": 0.01,  # every update moves the weights, rewards or not
        },
    )
    result = train(load_config(None, over))
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_gloo_sends_each_version_to_the_rollout_process_and_counts_its_bytes(tmp_path):
    gloo = _run(tmp_path, "gloo")
    assert len(gloo) == STEPS and all(r["grad_norm"] > 0 for r in gloo)
    # the rollout process samples from the version each step sent it (a worker behind
    # the version it was sent refuses to sample)
    assert [r["policy_version"] for r in gloo] == list(range(STEPS))
    disk = _run(tmp_path, "disk")
    sent = [r["sync_bytes"] for r in gloo]
    assert sent[0] > 0 and sent == [r["sync_bytes"] for r in disk]  # the same encoded payload


def test_gloo_needs_a_rollout_worker_in_another_process(tmp_path):
    base = small_overrides(tmp_path, **{"sync.channel": "gloo"})
    with pytest.raises(ConfigError, match=r"sync.channel=gloo: .*cluster.backend=process"):
        rules.check(load_config(None, [*base, "cluster.backend=local"]))
    two = [*base, "cluster.backend=process", "cluster.rollout_workers=2"]
    with pytest.raises(ConfigError, match=r"sync.channel=gloo with cluster.rollout_workers=2"):
        rules.check(load_config(None, two))
