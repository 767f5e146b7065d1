"""Remote-mode training through the http sync channel: every codec trains, delta is exact."""

from __future__ import annotations

import json

import pytest

from rlpost.config import load_config
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides
from tests.integration.test_server import start_server, stop_server


def _run(tmp_path, tiny_dir, name: str, **sync) -> list[dict]:
    """A 3-step GRPO run against a fresh server; the rows of its training steps."""
    proc, url = start_server(tiny_dir, "--max-tokens-limit", "64", "--threads", "1")
    try:
        over = small_overrides(
            tmp_path / name,
            **{
                "model.path": str(tiny_dir),
                "rollout.engine": "remote",
                "rollout.engine.servers": json.dumps([url]),
                "train.steps": 3,
                "sft.steps": 3,
                "eval.every": 0,
                "sync.bucket_mb": 0.005,  # many buckets even for the tiny model
                **{f"sync.{k}": v for k, v in sync.items()},
            },
        )
        result = train(load_config(None, over))
    finally:
        stop_server(proc)
    return [h for h in result.history if "loss" in h]


def test_bf16_delta_samples_exactly_what_bf16_samples(tmp_path, tiny_dir):
    plain = _run(tmp_path, tiny_dir, "bf16", codec="bf16")
    delta = _run(tmp_path, tiny_dir, "delta", codec="bf16", **{"codec.delta": "true"})
    assert [r["policy_version"] for r in delta] == [0, 1, 2]
    for key in ("reward_mean", "response_length_mean", "truncated_frac"):
        assert [r[key] for r in delta] == [r[key] for r in plain], key
    # Two plain bf16 runs already differ in the gap's 4th significant digit (about 1e-7 of
    # logprob per token): the server batches concurrently sent prompts in arrival order, and
    # the batch shape moves the float sums. Delta adds nothing beyond that.
    gaps = [(d["logprob_gap"], p["logprob_gap"]) for d, p in zip(delta, plain, strict=True)]
    assert all(d == pytest.approx(p, rel=1e-3, abs=1e-6) for d, p in gaps), gaps


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "fp8", "mxfp4"])
def test_each_codec_trains_through_the_server(tmp_path, tiny_dir, codec):
    rows = _run(tmp_path, tiny_dir, codec, codec=codec)
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    gap = max(r["logprob_gap"] for r in rows)
    assert gap < (1e-3 if codec == "none" else 1.0)  # lossy codecs sample from other weights
