"""The run facts (CPU): each derived fact is answered once, from the config and the
registries, and the builders follow the record they are handed rather than the config."""

from __future__ import annotations

import dataclasses

import pytest

from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.resolved import ENGINES, resolve, resolve_step_plan


def test_the_default_run_serves_in_process_from_the_policys_memory():
    cfg = load_config(None, ["model.dtype=float32"])
    facts = resolve(cfg)
    assert (facts.device, facts.bf16, facts.engine, facts.backend) == ("cpu", False, "hf", "local")
    assert facts.engine_in_process and not facts.engine_over_http and facts.shares_storage
    assert facts.reference_copy == (cfg.algo.kl.beta > 0) and facts.group_relative
    assert facts.plan == resolve_step_plan(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.engine = "vllm"


@pytest.mark.parametrize(
    ("overrides", "in_process", "over_http", "shares"),
    [
        (["rollout.engine=remote", "rollout.engine.servers=[http://a:1]"], False, True, False),
        (["rollout.engine=vllm"], False, False, False),
        (["rollout.engine=hf_continuous"], True, False, False),  # generates across a sync
        (["rollout.partial=true"], True, False, False),  # auto: hf_continuous
    ],
)
def test_engine_traits_come_from_the_registry(overrides, in_process, over_http, shares):
    facts = resolve(load_config(None, ["model.dtype=float32", *overrides]))
    assert (
        facts.engine_in_process
        == in_process
        == (not ENGINES.trait(facts.engine, "loads_own_weights"))
    )
    assert (facts.engine_over_http, facts.shares_storage) == (over_http, shares)


def test_adapters_keep_a_reference_without_a_copy():
    facts = resolve(load_config(None, ["algo.kl.beta=0.05", "model.lora.rank=4"]))
    assert facts.plan.reference and not facts.reference_copy


def test_the_trainer_builder_follows_the_record_it_is_handed():
    cfg = load_config(None, ["algo.kl.beta=0.05", "model.tiny.hidden_size=32"])
    facts = resolve(cfg)
    no_ref = dataclasses.replace(facts, plan=dataclasses.replace(facts.plan, reference=False))
    model, tokenizer = build.build_policy(cfg)
    assert build.build_trainer_worker(cfg, model, tokenizer).describe()["has_reference"]
    worker = build.build_trainer_worker(cfg, build.build_policy(cfg)[0], tokenizer, facts=no_ref)
    assert not worker.describe()["has_reference"]
