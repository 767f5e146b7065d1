"""Engines are registered by name, each with the whole protocol, and the config value is the
name (CPU: the two in-process engines are built on the tiny model)."""

from __future__ import annotations

import inspect

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.pipeline import build
from rlpost.pipeline.rules import check
from rlpost.rollout.continuous import ContinuousEngine
from rlpost.rollout.hf_engine import HFEngine
from rlpost.rollout.protocol import ENGINES, RolloutEngine, SamplingParams
from rlpost.rollout.remote_engine import RemoteEngine
from rlpost.rollout.vllm_engine import VLLMEngine

METHODS = [
    name
    for name, member in inspect.getmembers(RolloutEngine)
    if inspect.isfunction(member) and not name.startswith("_")
]


def test_the_registry_holds_every_engine_the_config_can_name():
    assert ENGINES.names() == ["hf", "hf_continuous", "remote", "vllm"]
    assert ENGINES.with_trait("loads_own_weights") == ["remote", "vllm"]
    with pytest.raises(ConfigError, match="not one of hf, hf_continuous, vllm, remote"):
        check(load_config(None, ["rollout.engine=sglang"]))


@pytest.mark.parametrize("cls", [HFEngine, ContinuousEngine, RemoteEngine, VLLMEngine])
def test_every_engine_class_has_every_method_of_the_protocol(cls):
    assert set(METHODS) == {"generate", "load_weights", "throughput", "reset_stats", "close"}
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ([], "hf"),
        (["rollout.engine=hf_continuous"], "hf_continuous"),
        (["rollout.partial=true"], "hf_continuous"),
        (["pipeline.mode=async"], "hf_continuous"),
        (["pipeline.mode=one_step_off"], "hf"),
    ],
)
def test_hf_resolves_to_the_engine_its_mode_needs(overrides, name):
    assert build.engine_name(load_config(None, overrides)) == name


@pytest.mark.parametrize(("engine", "cls"), [("hf", HFEngine), ("hf_continuous", ContinuousEngine)])
def test_the_in_process_engines_are_built_by_name_and_serve(engine, cls):
    cfg = load_config(None, [f"rollout.engine={engine}", "model.tiny.hidden_size=32"])
    model, tokenizer = build.build_policy(cfg)
    worker = build.build_rollout_worker(cfg, model, tokenizer)
    try:
        assert type(worker.engine) is cls and isinstance(worker.engine, RolloutEngine)
        params = SamplingParams(max_tokens=3, stop_token_ids=(tokenizer.eos_token_id,))
        out = worker.engine.generate([[5, 6, 7]], params, n=2)
        assert len(out) == 2 and all(1 <= len(c.token_ids) <= 3 for c in out)
        worker.reset_stats()
        assert worker.throughput() == 0.0
        state = worker.state_dict()
        assert "engine_generator" in state
        worker.load_state_dict(state)
    finally:
        worker.close()
