import subprocess
import sys

import pytest

from rlpost.config import (
    Config,
    ConfigError,
    OptimConfig,
    RMConfig,
    describe_fields,
    load_config,
    parse_overrides,
)
from rlpost.pipeline.rules import check as check_names


def test_overrides_parse_yaml_scalars_and_nest():
    tree = parse_overrides(
        ["train.optim.lr=1e-5", "rollout.n=8", "data.task.ops=['+']", "model.path=null"]
    )
    assert tree == {
        "train": {"optim": {"lr": 1e-5}},
        "rollout": {"n": 8},
        "data": {"task": {"ops": ["+"]}},
        "model": {"path": None},
    }


def test_recipe_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train: {optim: {lr: 0.5}, steps: 3}\nrollout: {n: 4}\n")
    cfg = load_config(recipe, ["train.optim.lr=0.25"])
    assert cfg.train.optim.lr == 0.25 and cfg.train.steps == 3 and cfg.rollout.n == 4


def test_on_and_off_are_words_where_a_field_takes_them(tmp_path):
    """YAML reads on/off as booleans; train.packing's choices are the words."""
    for word in ("on", "off", "auto"):
        assert load_config(None, [f"train.packing={word}"]).train.packing == word
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train: {packing: off}\n")
    assert load_config(recipe, []).train.packing == "off"
    # a bool field keeps YAML's reading
    assert (
        load_config(None, ["model.gradient_checkpointing=on"]).model.gradient_checkpointing is True
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.lrx=1"], "unknown config key 'train.lrx'"),
        (["train.optim.lr=-1"], "train.optim.lr=-1"),
        (["algo.loss.clip_high=-0.1"], "config algo.loss.clip_high=-0.1: must be >= 0"),
        (["algo.loss.name=dppo", "algo.loss.divergence=l2"], "algo.loss.divergence='l2'"),
        (["algo.loss=dapo", "algo.loss.clip_hgh=0.3"], "unknown config key 'algo.loss.clip_hgh'"),
        (["algo.advantage.std_scope=global"], "config algo.advantage.std_scope='global'"),
        (["algo.loss.name=ppo_clipp"], "algo.loss.name='ppo_clipp': not one of ppo_clip, dapo"),
        (["algo.rollout_correction=tiss"], "algo.rollout_correction.name='tiss': not one of"),
        (  # a knob of another variant names the variants that have it
            ["algo.loss.tau_pos=2"],
            "config algo.loss.tau_pos: algo.loss.name=ppo_clip has no tau_pos; it is a parameter "
            "of sapo (set algo.loss.name)",
        ),
        (
            ["algo.rollout_correction.cap=3"],
            "algo.rollout_correction.name=none has no cap; it is a parameter of tis, seq_tis, "
            "seq_mask",
        ),
        (
            ["algo.policy_loss=dapo"],
            "algo.policy_loss=dapo: the key moved; write algo.loss=dapo",
        ),
        (
            ["algo.losses.dapo.clip_high=0.3"],
            "the key moved; write algo.loss.clip_high=0.3 (with algo.loss.name=dapo)",
        ),
        (
            ["algo.advantage_params.lam=0.9"],
            "write algo.advantage.lam=0.9 (with algo.advantage.name)",
        ),
        (["train.micro_batch_size=128", "train.mini_batch_size=64"], "micro_batch_size"),
        (["train.mini_batch_size=1000"], "larger than the rollout batch"),
        (["rollout.max_tokens=200"], "max_position_embeddings"),
        (["nolhs"], "not key=value"),
        (["data.task=file"], "data.task.train_path"),
        (["rollout.n=0"], "config rollout.n=0: must be >= 1"),
        (  # a list entry is named by its name, in words, not pydantic's index and phrasing
            ["data.sources=[{name: a, task: arith}, {name: b, task: arith, weight: 0}]"],
            "config data.sources[b].weight=0: must be > 0",
        ),
        (["data.sources=[{task: arith}]"], "config data.sources[0].name: is required"),
        (  # a task's keys sit in the task: an old key names its new place
            ["data.arith.max_operand=5"],
            "data.arith.max_operand=5: the key moved; write data.task.max_operand=5 (with "
            "data.task.name=arith)",
        ),
        (["data.train_path=t.jsonl"], "write data.task.train_path=t.jsonl (with data.task.name"),
        (
            ["data.sources=[{name: a, task: reasoning_gym, reasoning_gym: {task: x}}]"],
            "write data.sources[a].task.task=x (with data.sources[a].task.name=reasoning_gym)",
        ),
        (["eval.sets=[{name: s, stream: true}]"], "eval.sets[s].stream=true: the key moved"),
    ],
)
def test_bad_config_is_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        check_names(load_config(None, overrides))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["rollout.n=1", "train.mini_batch_size=16", "train.micro_batch_size=16"],
            "rollout.n=1 gives every grpo group zero advantage",
        ),
    ],
)
def test_registry_checks_name_the_key(overrides, needle):
    # Checked against the registries' traits and signatures before any work starts.
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        check_names(cfg)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def rows_of(*overrides):
    return {k: (v, h) for k, v, h in describe_fields(Config, "", load_config(None, overrides))}


def test_a_choice_lists_the_chosen_variants_parameters_only_with_their_defaults():
    assert rows_of("algo.loss=dapo")["algo.loss.clip_high"][0] == "0.28"
    assert rows_of()["algo.loss.clip_high"][0] == "0.2"
    assert rows_of("algo.loss=dppo")["algo.loss.is_cap"][0] == "20.0"
    otb = rows_of("algo.advantage=optimal_token_baseline")
    assert otb["algo.advantage.eps"][0] == "1e-08"
    assert "algo.advantage.norm_by_std" not in otb and "algo.loss.tau_pos" not in otb
    assert [k for k in rows_of() if k.startswith("algo.rollout_correction.")] == [
        "algo.rollout_correction.name"
    ]
    for key, (_, help_text) in {**rows_of("algo.loss=gkd"), **otb}.items():
        if key.startswith(("algo.loss.", "algo.advantage.")):
            assert help_text and "(0." not in help_text, key  # help, no default in prose


def test_choosing_another_variant_starts_from_its_defaults(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo:\n  loss: {name: dapo, clip_high: 0.3}\n")
    assert load_config(recipe).algo.loss.clip_high == 0.3
    assert load_config(recipe, ["algo.loss.clip_low=0.1"]).algo.loss.clip_high == 0.3
    gspo = load_config(recipe, ["algo.loss.name=gspo"]).algo.loss
    assert (gspo.name, gspo.clip_high) == ("gspo", 4e-4)  # not dapo's 0.3
    child = tmp_path / "c.yaml"
    child.write_text("base: r.yaml\nalgo:\n  loss: sapo\n")
    assert load_config(child).algo.loss.model_dump() == {
        "name": "sapo",
        "tau_pos": 1.0,
        "tau_neg": 1.05,
    }
    bare = tmp_path / "b.yaml"  # a bare name in the base, a parameter over it
    bare.write_text("algo:\n  loss: dapo\n")
    assert load_config(bare, ["algo.loss.clip_low=0.1"]).algo.loss.name == "dapo"


def test_missing_and_malformed_recipe(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_every_field_has_help():
    rows = describe_fields(Config)
    assert len(rows) > 40
    missing = [k for k, _, h in rows if not h]
    assert not missing, missing


def test_cli_bad_key_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", "train.bogus=1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "train.bogus" in proc.stderr


def test_cli_unknown_algorithm_names_valid_ones(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlpost.cli",
            "train",
            "algo.loss=ppo_clipp",
            f"run.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "ppo_clip" in proc.stderr and "not one of" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_old_layout_is_refused_with_the_new_key():
    old = {"algo": {"policy_loss": "ppo_clip", "losses": {"ppo_clip": {"clip_low": 0.2}}}}
    with pytest.raises(ValueError, match=r"write algo\.loss=ppo_clip"):
        Config.model_validate(old)


def test_the_engine_choice_names_every_registered_engine_and_refuses_others():
    import rlpost.rollout  # noqa: F401  (registers the engines)
    from rlpost.config import choices
    from rlpost.resolved import ENGINES

    assert sorted(choices()["rollout.engine"][0]) == sorted(["auto", *ENGINES.names()])
    with pytest.raises(ConfigError, match=r"rollout\.engine\.name='hff': not one of auto, hf, "):
        load_config(None, ["rollout.engine=hff"])
    with pytest.raises(ConfigError, match=r"write rollout\.engine\.servers=\['http://a'\]"):
        load_config(None, ["rollout.servers=[http://a]"])


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("train.lr=1e-4", "write train.optim.lr=0.0001"),
        ("sft.grad_clip=2", "write sft.optim.grad_clip=2"),
        ("dpo.warmup_steps=3", "write dpo.optim.warmup_steps=3"),
        ("rm.weight_decay=0.1", "write rm.optim.weight_decay=0.1"),
        ("critic.warmup_steps=3", "or critic.head_start_steps"),
    ],
)
def test_an_optimizer_key_written_flat_names_its_new_key(override, fix):
    with pytest.raises(ConfigError, match="the key moved") as err:
        load_config(None, [override])
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_every_section_that_trains_has_one_optimizer_type_with_its_own_defaults():
    cfg = load_config(None, ["sft.optim.lr=1e-4", "critic.optim.grad_clip=0.5", "dpo.steps=1"])
    cfg.rm = RMConfig()
    optims = [cfg.train.optim, cfg.critic.optim, cfg.sft.optim, cfg.dpo.optim, cfg.rm.optim]
    assert {type(o) for o in optims} == {OptimConfig}
    assert cfg.sft.optim.lr == 1e-4 and cfg.sft.optim.warmup_steps == 20  # the rest: sft's
    assert cfg.critic.optim.lr == 1e-3 and cfg.critic.optim.grad_clip == 0.5
    assert cfg.train.optim.lr == 1e-5 and cfg.dpo.optim.lr == 5e-4


@pytest.mark.parametrize("section", ["sft", "critic", "dpo", "rm"])
def test_auto_lr_is_the_rl_policys_alone(section):
    assert load_config(None, ["train.optim.lr=auto"]).train.optim.lr == "auto"
    with pytest.raises(ConfigError, match=f"{section}.optim.lr=auto: only the RL policy") as err:
        load_config(
            None,
            [f"{section}.optim.lr=auto", "dpo.steps=1"]
            if section == "dpo"
            else [f"{section}.optim.lr=auto"],
        )
    assert "\n" not in str(err.value)


def test_a_bad_lr_names_the_key_without_pydantics_union_labels():
    for value, reason in (("0", "must be > 0"), ("x", "valid number")):
        with pytest.raises(ConfigError, match=reason) as err:
            load_config(None, [f"train.optim.lr={value}"])
        assert f"config train.optim.lr={value!r}" in str(
            err.value
        ) or f"train.optim.lr={value}" in str(err.value)
        assert "constrained" not in str(err.value)


def test_an_override_of_a_whole_mapping_replaces_the_recipes_and_a_dotted_one_adds(tmp_path):
    """``cluster.rollout.resources={solo: 1}`` on resume over a saved ``{rollout_node: 1}``
    places the workers by ``solo`` alone; ``...resources.solo=1`` adds one entry."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("cluster:\n  rollout:\n    resources: {rollout_node: 1}\n")
    key = "cluster.rollout.resources"
    assert load_config(recipe, [f"{key}={{solo: 1}}"]).cluster.rollout.resources == {"solo": 1}
    both = {"rollout_node": 1, "solo": 1}
    assert load_config(recipe, [f"{key}.solo=1"]).cluster.rollout.resources == both
    later = load_config(recipe, [f"{key}={{solo: 1}}", f"{key}.x=2"]).cluster.rollout.resources
    assert later == {"solo": 1, "x": 2}
    sandbox = load_config(recipe, ["agent.env=python", "agent.env.sandbox={a: 1}"]).agent.env
    assert sandbox.sandbox == {"a": 1}
