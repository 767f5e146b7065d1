"""The rule table (CPU): each rule has a case it refuses and passes the default, the table is
complete, and ``rlpost config`` refuses exactly what the command it checks as refuses."""

from __future__ import annotations

import pytest
import torch

from rlpost.cli import main
from rlpost.config import ConfigError, load_config
from rlpost.pipeline import rules

PAIRS = ["data.task=prefs"]  # the passing base of the rules only rlpost dpo runs

# rule name -> (command, passing base overrides, the overrides that break it, text of its line)
CASES = {
    "micro_batch_fits_mini_batch": (
        "train",
        [],
        ["train.micro_batch_size=128", "train.mini_batch_size=64"],
        "train.micro_batch_size=128",
    ),
    "mini_batch_fits_rollout_batch": (
        "train",
        [],
        ["train.mini_batch_size=1000"],
        "train.mini_batch_size=1000",
    ),
    "group_relative_needs_groups": (
        "train",
        [],
        ["rollout.n=1", "train.mini_batch_size=16", "train.micro_batch_size=16"],
        "rollout.n=1",
    ),
    "prompts_not_pairs": ("train", [], ["data.task=prefs"], "data.task=prefs"),
    "file_task_needs_train_path": (
        "train",
        [],
        ["data.task=file", "data.task.eval_path=e.jsonl"],
        "data.task.train_path=None: data.task=file reads its rows",
    ),
    "file_task_needs_eval_path": (
        "eval",
        [],
        ["data.task=file", "data.task.train_path=t.jsonl"],
        "data.task.eval_path=None: data.task=file reads the rows it evaluates",
    ),
    "pairs_not_prompts": ("dpo", PAIRS, ["data.task=arith"], "data.task=arith"),
    "tiny_context_fits_max_tokens": ("train", [], ["rollout.max_tokens=200"], "max_tokens=200"),
    "remote_needs_servers": ("train", [], ["rollout.engine=remote"], "rollout.engine=remote"),
    "vllm_needs_model_path": ("train", [], ["rollout.engine=vllm"], "rollout.engine=vllm"),
    "batch_engine_runs_whole_batches": (
        "train",
        ["rollout.engine=hf"],
        ["rollout.partial=true"],
        "rollout.engine=hf with rollout.partial=true",
    ),
    "partial_needs_sync_mode": (
        "train",
        [],
        ["rollout.partial=true", "pipeline.mode=async"],
        "rollout.partial=true with pipeline.mode=async",
    ),
    "rollout_logprobs_need_full_distribution": (
        "train",
        [],
        ["algo.old_logprobs=rollout", "rollout.top_p=0.9"],
        "rollout.top_p=0.9",
    ),
    "rollout_logprobs_need_no_correction": (
        "train",
        [],
        ["algo.old_logprobs=rollout", "algo.rollout_correction.name=tis"],
        "algo.rollout_correction.name=tis",
    ),
    "rollout_logprobs_need_trainer_numbers": (
        "train",
        [],
        ["algo.old_logprobs=rollout", "sync.codec=bf16"],
        "sync.codec=bf16",
    ),
    "algorithm_parts_resolve": (
        "train",
        [],
        ["algo.kl.estimator=nope"],
        "algo.kl.estimator=nope: unknown KL estimator 'nope'",
    ),
    "component_estimator_needs_outcome_rewards": (
        "train",
        [],
        ["algo.advantage=gdpo", "algo.kl.placement=reward"],
        "algo.advantage=gdpo with algo.kl.placement=reward",
    ),
    "reward_terms_resolve": ("train", [], ["reward.terms=[{name: nope}]"], "reward.terms"),
    "agent_env_resolves": (
        "train",
        [],
        ["agent.env=python", "agent.env.sandbox={timeout: 3}"],
        "agent.env",
    ),
    "sync_channel_is_wired": ("train", [], ["sync.channel=gloo"], "sync.channel=gloo"),
    "disk_channel_one_rollout_worker": (
        "train",
        ["sync.channel=disk"],
        ["cluster.rollout_workers=2", "cluster.backend=process"],
        "sync.channel=disk with cluster.rollout_workers=2",
    ),
    "on_policy_servers_take_weights": (
        "train",
        ["rollout.engine=remote", "rollout.engine.servers=[http://x:1]"],
        ["rollout.engine.server=openai"],
        "rollout.engine.server=openai: an endpoint that cannot take weights",
    ),
    "vllm_server_takes_plain_weights": (
        "train",
        ["rollout.engine=remote", "rollout.engine.servers=[http://x:1]"],
        ["rollout.engine.server=vllm", "sync.codec=bf16"],
        "vllm serve loads a plain weight file",
    ),
    "engine_logprobs_of_the_full_distribution": (
        "train",
        ["rollout.engine=vllm", "model.path=/nonexistent", "algo.rollout_correction.name=tis"],
        ["rollout.top_p=0.9"],
        "vLLM's logprobs are of the truncated distribution",
    ),
    "data_parallel_cuts_by_rows": (
        "train",
        ["cluster.trainer_workers=2", "cluster.backend=process"],
        ["train.max_tokens_per_micro_batch=4096"],
        "data-parallel ranks cut micro-batches by rows",
    ),
    "no_inert_knobs": (
        "train",
        [],
        ["algo.kl.horizon=5000"],
        "algo.kl.horizon=5000: nothing reads it",
    ),
    "delta_needs_acknowledging_readers": (
        "train",
        [],
        ["sync.codec.delta=true", "sync.codec=bf16", "sync.channel=disk"],
        "sync.codec.delta=true with sync.channel=disk",
    ),
    "local_backend_one_worker_per_role": (
        "train",
        [],
        ["cluster.backend=local", "cluster.trainer_workers=2"],
        "cluster.backend=local",
    ),
    "reward_workers_need_ray": ("train", [], ["cluster.reward_workers=1"], "reward_workers=1"),
    "suspect_before_dead": (
        "train",
        [],
        ["cluster.suspect_after_s=100", "cluster.dead_after_s=50"],
        "cluster.suspect_after_s=100.0",
    ),
    "data_parallel_without_critic": (
        "train",
        [],
        ["cluster.trainer_workers=2", "algo.advantage=gae"],
        "cluster.trainer_workers=2",
    ),
    "data_parallel_without_adapters": (
        "train",
        [],
        ["cluster.trainer_workers=2", "model.lora.rank=4"],
        "model.lora.rank=4",
    ),
    "fleet_without_partial": (
        "train",
        [],
        ["cluster.rollout_workers=2", "rollout.partial=true"],
        "cluster.rollout_workers=2 with rollout.partial=true",
    ),
    "fleet_not_over_remote": (
        "train",
        [],
        [
            "cluster.rollout_workers=2",
            "rollout.engine=remote",
            "rollout.engine.servers=[http://x:1]",
        ],
        "cluster.rollout_workers=2 with rollout.engine=remote",
    ),
    "device_is_visible": ("train", [], ["run.device=cuda"], "run.device=cuda"),
    "sft_file_needs_train_path": ("sft", [], ["sft.data=file"], "sft.data=file needs"),
    "conversations_are_for_rlpost_sft": (
        "train",
        [],
        ["sft.data=chat_arith"],
        "sft.data=chat_arith trains on conversations with rlpost sft only",
    ),
}
SRC = "data.sources=[{name: a, task: arith}]"
CASES.update(
    {
        "sources_named_once": (
            "train", [], ["data.sources=[{name: a, task: arith}, {name: a, task: code}]"],
            "data.sources name=a: two share the name",
        ),
        "sources_replace_one_source_keys": (
            "train", [SRC], ["data.task=code"], "data.task=code: data.sources replaces it",
        ),
        "source_keys_fit_its_task": (
            "train", [], ["data.sources=[{name: a}]"],
            "data.sources[a].task.train_path=None: a file source needs it",
        ),
        "source_rewards_resolve": (
            "train", [], ["data.sources=[{name: a, task: arith, reward: [{name: nope}]}]"],
            "data.sources[a].reward: unknown reward 'nope'",
        ),
        "reasoning_gym_task_generates": (
            "train", [],
            ["data.sources=[{name: g, task: {name: reasoning_gym, task: nope}}]"],
            "data.sources[g].task.task=nope:",
        ),
    }
)  # fmt: skip
SET = "eval.sets=[{name: s, task: arith, metrics: [pass@4]}]"
CASES.update(
    {
        "eval_set_metrics_known": (
            "eval", [SET], ["eval.sets=[{name: s, task: arith, metrics: [best@4]}]"],
            "eval.sets[s].metrics=best@4: 'best@4' is not mean@k",
        ),
        "eval_set_k_within_samples": (
            "train", [SET], ["eval.sets=[{name: s, task: arith, metrics: [maj@8], samples: 4}]"],
            "eval.sets[s].samples=4: maj@8 needs at least 8 samples",
        ),
    }
)  # fmt: skip
CASES["rm_margin_needs_a_file"] = (
    "rm",
    PAIRS,
    ["rm.margin_field=margin"],
    "rm.margin_field=margin: data.task=prefs",
)
CASES["agent_harness_runs"] = (  # remote servers pass: sessions open over their admin routes
    "train",
    [
        "agent.harness.command=[python, agent.py]",
        "rollout.engine=remote",
        "rollout.engine.servers=[http://127.0.0.1:9]",
    ],
    ["rollout.engine=vllm"],
    "rollout.engine=vllm: agent.harness records sessions on the run's in-process engine or on rlpost servers",
)
CASES.update(
    {
        "distillation_has_one_teacher": (
            "train", [], ["algo.advantage=on_policy_distill"], "model.teacher.path=None",
        ),
        "gkd_needs_local_teacher": (
            "train", [], ["algo.loss=gkd", "model.teacher.url=http://127.0.0.1:8000"],
            "model.teacher.url=http://127.0.0.1:8000",
        ),
        "distillation_weights_not_both_zero": (
            "train", [],
            ["algo.advantage=on_policy_distill", "algo.advantage.distill_weight=0"],
            "algo.advantage.distill_weight=0",
        ),
    }
)  # fmt: skip
RULE = {r.name: r for r in rules.RULES}


def test_every_rule_has_a_case_and_every_case_a_rule():
    assert sorted(CASES) == sorted(RULE)
    assert len(RULE) == len(rules.RULES)  # one function per name


@pytest.fixture
def no_gpu(monkeypatch):
    # The device rule's case must hold on a machine with a GPU too.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_refuses_its_case_in_one_line_and_passes_the_base(name, no_gpu):
    command, base, bad, text = CASES[name]
    r = RULE[name]
    assert command in r.commands
    assert r.check(load_config(None, base)) is None
    line = r.check(load_config(None, [*base, *bad]))
    assert line is not None and text in line, line
    assert "\n" not in line and ";" in line, line  # reason; fix


def test_the_shipped_default_passes_the_whole_table_for_every_command_but_dpo():
    cfg = load_config(None)
    for command in ("train", "sft", "eval"):
        assert rules.problems(cfg, command) == []
    assert rules.problems(load_config(None, PAIRS), "dpo") == []


def test_check_reports_the_first_problem_of_the_table():
    cfg = load_config(None, ["algo.kl.horizon=5000", "rollout.engine=vllm"])
    found = rules.problems(cfg)
    assert len(found) == 2
    with pytest.raises(ConfigError) as err:
        rules.check(cfg)
    assert str(err.value) == found[0]


def test_an_eval_config_with_only_a_held_out_file_passes_as_eval_not_as_train():
    cfg = load_config(None, ["data.task=file", "data.task.eval_path=e.jsonl"])
    assert rules.problems(cfg, "eval") == []
    assert [line.split(";")[0] for line in rules.problems(cfg, "train")] == [
        "data.task.train_path=None: data.task=file reads its rows (prompts, or pairs for dpo and "
        "rm) from it"
    ]


PARITY = [
    ["data.task=file", "data.task.eval_path=e.jsonl"],
    ["sync.delta=true"],
    ["sync.codec=bf16", "sync.codec.delta=true", "sync.channel=disk"],
    ["rollout.engine=vllm"],
    ["cluster.backend=local", "cluster.trainer_workers=2"],
    ["cluster.backend=local", "cluster.rollout_workers=2"],
    ["rollout.n=1", "train.mini_batch_size=16", "train.micro_batch_size=16"],
    ["algo.loss.tau_pos=2"],
    ["algo.advantage=gae", "algo.advantage.alpha=1"],
    ["algo.loss_params.clip_high=0.3"],
    ["cluster.suspect_after_s=100", "cluster.dead_after_s=50"],
]


@pytest.mark.parametrize("overrides", PARITY, ids=lambda o: " ".join(o))
def test_config_and_train_refuse_the_same_way(overrides, tmp_path, capsys):
    out = f"run.output_dir={tmp_path}"
    lines = []
    for command in (["config"], ["train"], ["config", "--for", "train"]):
        assert main([*command, *overrides, out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        lines.append(err)
    assert lines[0] == lines[1] == lines[2]
    assert lines[0].startswith("rlpost: error: ")
    assert not (tmp_path / "grpo_arith").exists()  # refused before any work


def test_config_checks_dpo_recipes_as_dpo(tmp_path, capsys):
    assert main(["config", "dpo_prefs"]) == 0
    capsys.readouterr()
    bad = ["data.task=file", "data.task.eval_path=e.jsonl", f"run.output_dir={tmp_path}"]
    assert main(["config", "--for", "dpo", "dpo_prefs", *bad]) == 2
    as_config = capsys.readouterr().err.strip()
    assert main(["dpo", "dpo_prefs", *bad]) == 2
    assert capsys.readouterr().err.strip() == as_config
    assert "data.task.train_path" in as_config


@pytest.mark.parametrize(
    "overrides, text",
    [
        (["eval.sets=[{name: s, task: arith, metrics: []}]"], "eval.sets[s].metrics=[]"),
        (["eval.sets=[{name: s, task: arith, metrics: [greedy, greedy]}]"], "listed twice"),
        (["eval.sets=[{name: s, task: arith, metrics: [pass@4, mean@16], samples: 8}]"], "mean@16"),
        (["eval.sets=[{name: s, task: file}]"], "eval.sets[s].task.eval_path=None: a file set"),
        (["eval.sets=[{name: s, task: {name: file, train_path: t, eval_path: e}}]"], "trains on"),
        (["eval.sets=[{name: g, task: {name: reasoning_gym, task: nope}}]"], "g].task.task=nope:"),
        (["eval.sets=[{name: s, task: arith}, {name: s, task: code}]"], "eval.sets name=s: two"),
        (
            [SRC, "eval.sets=[{name: a, task: arith, reward: [{name: exact_match}]}]"],
            "eval.sets[a].reward: data.sources[a]'s terms score the set of its name",
        ),
        (["eval.sets=[{name: s, task: arith, weight: 2}]"], "eval.sets[s].weight=2.0"),
        (["eval.sets=[{name: s, task: arith, reward: []}]"], "eval.sets[s].reward=[]"),
    ],
)
def test_eval_set_rules_refuse_the_other_mistakes(overrides, text):
    found = rules.problems(load_config(None, overrides), "train")
    assert found and text in found[0], found
    assert "\n" not in found[0] and ";" in found[0]


def test_an_eval_set_sized_by_its_metrics_passes():
    cfg = load_config(None, ["eval.sets=[{name: s, task: arith, metrics: [mean@8, maj@4]}]"])
    assert cfg.eval.sets[0].n == 8
    assert rules.problems(cfg, "train") == []


TRUST_REGION_LOSS = """
from typing import Literal

from pydantic import BaseModel

from rlpost.algos.policy_losses import TRUST_REGION, flash_reinforce_loss
from rlpost.params import TrustRegionParams
from rlpost.registry import part


class Params(BaseModel):
    divergence: Literal["binary_kl", "tv"] = "binary_kl"
    tr_kl: float = 0.05
    tr_tv: float = 0.2
    is_cap: float = 2.0


@part(params=Params{traits})
def mine(x, p):
    return flash_reinforce_loss(x, TrustRegionParams(**p.params()))
"""


@pytest.mark.parametrize(
    ("rule", "bad"),
    [
        ("rollout_logprobs_need_no_correction", ["algo.old_logprobs=rollout"]),
        ("no_inert_knobs", ["algo.loss.tr_tv=0.5"]),
        ("no_inert_knobs", ["algo.loss.divergence=tv", "algo.loss.tr_kl=0.1"]),
    ],
)
def test_a_users_loss_declaring_the_traits_meets_the_built_in_rules(rule, bad, tmp_path):
    """The rules read a loss's traits, never its name: a loss from a file that declares
    flash_reinforce's traits is refused in the same words, one that declares none passes."""
    traits = ", corrects_rollout=True, read_when=TRUST_REGION"
    (tmp_path / "declared.py").write_text(TRUST_REGION_LOSS.format(traits=traits))
    (tmp_path / "plain.py").write_text(TRUST_REGION_LOSS.format(traits=""))
    built_in = RULE[rule].check(load_config(None, ["algo.loss=flash_reinforce", *bad]))
    assert built_in is not None
    declared, plain = (f"{tmp_path / name}.py:mine" for name in ("declared", "plain"))
    line = RULE[rule].check(load_config(None, [f"algo.loss.name={declared}", *bad]))
    assert line is not None and line.replace(declared, "flash_reinforce") == built_in, line
    assert RULE[rule].check(load_config(None, [f"algo.loss.name={plain}", *bad])) is None
