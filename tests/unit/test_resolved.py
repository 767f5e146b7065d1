"""The run facts (CPU): each derived fact is answered once, from the config and the
registries, and the builders follow the record they are handed rather than the config."""

from __future__ import annotations

import dataclasses

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.pipeline import build
from rlpost.resolved import ENGINES, TrainerLayout, resolve, resolve_step_plan


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


@pytest.mark.parametrize(
    ("workers", "pp", "tp", "layout"),
    [(1, 1, 1, (1, 1, 1)), (4, 1, 2, (2, 1, 2)), (4, 2, 1, (2, 2, 1)), (8, 2, 2, (2, 2, 2))],
)
def test_the_trainer_layout_is_one_record_every_user_reads(workers, pp, tp, layout):
    over = [f"cluster.trainer_workers={workers}", f"cluster.pipeline_parallel={pp}"]
    cfg = load_config(None, [*over, f"cluster.tensor_parallel={tp}", "cluster.backend=process"])
    got = resolve(cfg).layout
    assert (got.dp, got.pp, got.tp) == layout and got.world == workers
    assert got.split == (pp * tp > 1)
    from rlpost.pipeline.memory import rank_params

    # the memory estimate splits what one rank holds by the same record
    shape = {"params": 800.0, "split": 0.0, "layers": 2, "layer_params": 0}
    assert rank_params(cfg, shape) == pytest.approx(800.0 / layout[0])


@pytest.mark.parametrize(
    ("workers", "pp", "tp", "named"),
    [
        (3, 1, 2, "cluster.tensor_parallel=2 does not divide cluster.trainer_workers=3"),
        (3, 2, 1, "cluster.pipeline_parallel=2 does not divide cluster.trainer_workers=3"),
        (6, 2, 2, "cluster.pipeline_parallel=2 x cluster.tensor_parallel=2 does not divide"),
    ],
)
def test_a_layout_that_does_not_fit_is_one_line_from_the_record_and_the_rule(
    workers, pp, tp, named
):
    over = [f"cluster.trainer_workers={workers}", f"cluster.pipeline_parallel={pp}"]
    cfg = load_config(None, [*over, f"cluster.tensor_parallel={tp}", "cluster.backend=process"])
    with pytest.raises(ConfigError, match="trainer_workers to a multiple of") as err:
        TrainerLayout.of(cfg.cluster)
    assert named in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as by_facts:
        resolve(cfg)
    assert str(by_facts.value) == str(err.value)
    from rlpost.pipeline import rules

    with pytest.raises(ConfigError) as by_rules:  # the rules read the same record
        rules.check(cfg)
    assert str(by_rules.value) == str(err.value)
