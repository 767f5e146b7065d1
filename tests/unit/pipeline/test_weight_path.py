"""The run's weight path: the kind follows from the config, and its counts are what it sent."""

from __future__ import annotations

import torch

from rlpost.config import load_config
from rlpost.pipeline.weights import ChannelPath, DirectPath, build_weight_path
from rlpost.train.worker import WeightsExport
from tests.unit.sync.engines import DictEngine, toy_weights


def _cfg(*overrides):
    return load_config(None, list(overrides))


def _export(weights, version):
    return WeightsExport(version, list(weights.items()))


def test_plain_config_copies_directly_and_counts_the_trainer_bytes():
    w = toy_weights()
    engine = DictEngine({k: torch.zeros_like(v) for k, v in w.items()})
    path = build_weight_path(_cfg(), engine)
    assert isinstance(path, DirectPath)
    m = path.push(_export(w, 3))
    assert engine.version == 3 and torch.equal(
        engine.weights["lm_head.weight"], w["lm_head.weight"]
    )
    assert m["sync_bytes"] == sum(t.numel() * 4 for t in w.values())
    assert path.take_sent() == m["sync_bytes"] and path.take_sent() == 0.0


def test_a_codec_goes_through_the_sync_layer_and_counts_the_encoded_bytes():
    w = toy_weights()
    fp32 = sum(t.numel() * 4 for t in w.values())
    engine = DictEngine({k: torch.zeros_like(v) for k, v in w.items()})
    path = build_weight_path(_cfg("sync.codec=bf16", "sync.codec.delta=true"), engine)
    try:
        assert isinstance(path, ChannelPath)
        first = path.push(_export(w, 1))
        assert engine.version == 1 and first["sync_bytes"] == fp32 // 2  # bf16, no base yet
        second = path.push(_export(w, 2))  # unchanged weights: a delta of nothing
        assert engine.version == 2 and second["sync_bytes"] < 0.01 * first["sync_bytes"]
        assert path.take_sent() == first["sync_bytes"] + second["sync_bytes"]
    finally:
        path.close()
