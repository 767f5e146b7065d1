"""Remote-mode training reports the bytes on the wire: per-step ``sync_bytes`` in
metrics.jsonl is what the run's weight path sent to ``rlpost serve``, so codecs and delta show
in it (fp8 about half of bf16; a delta at a tiny learning rate a small fraction)."""

from __future__ import annotations

import json

import pytest

from rlpost.config import load_config
from rlpost.models.tiny import save_tiny_checkpoint
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides
from tests.integration.test_server import start_server, stop_server


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny checkpoint whose MLP weights outweigh the embeddings (which fp8 keeps in bf16)."""
    out = tmp_path_factory.mktemp("wide") / "model"
    return save_tiny_checkpoint(out, hidden_size=64, intermediate_size=512)


def _sync_bytes(tmp_path, model_dir, name: str, **sync) -> list[float]:
    """Per-step ``sync_bytes`` of a 3-step run against a fresh server, from metrics.jsonl
    (every step's update moved the weights)."""
    proc, url = start_server(model_dir, "--max-tokens-limit", "64", "--threads", "1")
    try:
        over = small_overrides(
            tmp_path / name,
            **{
                "model.path": str(model_dir),
                "rollout.engine": "remote",
                "rollout.engine.servers": json.dumps([url]),
                "train.steps": 3,
                "train.optim.lr": 1e-6,
                # an untrained model scores 0 (zero advantages): the entropy bonus keeps each
                # update non-zero, so the delta carries a real step
                "algo.entropy_coef": 0.01,
                "sft.steps": 0,
                "eval.every": 0,
                "eval.limit": 4,
                "checkpoint.every": 0,
                **{f"sync.{k}": v for k, v in sync.items()},
            },
        )
        result = train(load_config(None, over))
    finally:
        stop_server(proc)
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "loss" in r]
    assert steps and all(r["grad_norm"] > 0 for r in steps)
    return [r["sync_bytes"] for r in steps]


def test_sync_bytes_are_the_bytes_each_codec_sends(tmp_path, wide_dir):
    bf16 = _sync_bytes(tmp_path, wide_dir, "bf16", codec="bf16")
    fp8 = _sync_bytes(tmp_path, wide_dir, "fp8", codec="fp8")
    delta = _sync_bytes(tmp_path, wide_dir, "delta", codec="bf16", **{"codec.delta": "true"})
    assert len(bf16) == len(fp8) == len(delta) == 3
    assert len(set(bf16)) == 1 and bf16[0] > 0  # a full bf16 encoding every step
    assert all(0 < b <= 0.55 * bf16[0] for b in fp8), (fp8, bf16)
    # the first update goes against the base the servers acknowledged at start: a delta too
    assert all(0 < b <= 0.1 * bf16[0] for b in delta), (delta, bf16)
