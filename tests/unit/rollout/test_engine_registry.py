"""Engines register themselves by name, each with the whole protocol, and the config value is
the name; ``auto`` picks the in-process engine the run needs and an explicit engine is kept or
refused, never swapped (CPU: the two in-process engines are built on the tiny model)."""

from __future__ import annotations

import inspect

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.pipeline import build
from rlpost.pipeline.rules import check
from rlpost.resolved import ENGINES, resolve
from rlpost.rollout.engines.continuous import ContinuousEngine
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import RolloutEngine, SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.rollout.engines.vllm import VLLMEngine

METHODS = [
    name
    for name, member in inspect.getmembers(RolloutEngine)
    if inspect.isfunction(member) and not name.startswith("_")
]


def test_the_registry_holds_every_engine_the_config_can_name():
    assert ENGINES.names() == ["hf", "hf_continuous", "remote", "vllm"]
    assert [n for n in ENGINES.names() if ENGINES.trait(n, "loads_own_weights")] == [
        "remote",
        "vllm",
    ]
    with pytest.raises(ConfigError, match="not one of auto, hf, hf_continuous, vllm, remote"):
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
        (["pipeline.mode=one_step_off", "rollout.engine=hf"], "hf"),
        (["rollout.engine=hf"], "hf"),
    ],
)
def test_auto_resolves_to_the_engine_its_mode_needs_and_a_named_one_is_kept(overrides, name):
    cfg = check(load_config(None, overrides))
    assert resolve(cfg).engine == name


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["rollout.partial=true"], "rollout.partial=true"),
        (["pipeline.mode=async"], "pipeline.mode=async"),
        (["agent.harness.command=[run]"], "agent.harness"),
    ],
)
def test_the_batch_engine_named_where_it_cannot_run_is_refused_in_one_line(overrides, key):
    cfg = load_config(None, ["rollout.engine=hf", *overrides])
    with pytest.raises(ConfigError, match=f"rollout.engine=hf with {key}: .*hf_continuous") as e:
        check(cfg)
    assert "\n" not in str(e.value)


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
