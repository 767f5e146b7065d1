"""Keys that moved: the old spelling is one line naming the new key (rlpost.config.MOVED)."""

import subprocess
import sys

import pytest

from rlpost.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "sync.delta=true",
            "sync.delta=true: the key moved; write sync.codec.delta=true (with "
            "sync.codec.name=bf16)",
        ),
        ("sync.delta_full_threshold=0.5", "write sync.codec.delta_full_threshold=0.5 (with"),
        (
            "sync.keep_bf16=[norm]",
            "sync.keep_bf16=[norm]: the key moved; write sync.codec.keep_bf16=[norm] (with "
            "sync.codec.name=fp8 or mxfp4)",
        ),
        (
            "agent.params.step_reward=0.2",
            "agent.params.step_reward=0.2: the key moved; write agent.env.step_reward=0.2 (with "
            "agent.env.name)",
        ),
        (
            "agent.harness.entry=my_agent.py:run",
            "agent.harness.entry=my_agent.py:run: the key moved; write "
            "agent.harness.name=my_agent.py:run",
        ),
        (
            "reward.terms=[{name: numeric_match, params: {position: last}}]",
            "reward.terms[numeric_match].params.position=last: the key moved; write "
            "reward.terms[numeric_match].position=last",
        ),
        (
            "data.sources=[{name: a, task: arith, reward: [{name: exact_match, params: {tag: b}}]}]",
            "write data.sources[a].reward[exact_match].tag=b",
        ),
    ],
)
def test_cli_old_spelling_names_the_new_key_and_exits_2(override, line, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "config", "grpo_arith", override],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert line in proc.stderr


def test_a_recipe_written_the_old_way_is_refused_at_its_key(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(
        "base: grpo_arith\n"
        "reward: {terms: [{name: numeric_match, weight: 2, params: {position: last}}]}\n"
    )
    with pytest.raises(ConfigError, match=r"^reward\.terms\[numeric_match\]\.params\.position"):
        load_config(recipe)
    recipe.write_text("sync: {codec: bf16, delta: true}\n")
    with pytest.raises(ConfigError, match=r"^sync\.delta=true: the key moved"):
        load_config(recipe)


def test_the_new_spellings_choose_and_set():
    cfg = load_config(None, ["sync.codec=fp8", "sync.channel=http"])
    assert (cfg.sync.codec.name, cfg.sync.codec.keep_bf16, cfg.sync.channel.name) == (
        "fp8",
        ["embed", "lm_head", "norm"],
        "http",
    )
    cfg = load_config(None, ["sync.codec.name=bf16", "sync.codec.delta=true"])
    assert cfg.sync.delta and cfg.sync.codec.delta_full_threshold == 0.3
    with pytest.raises(ConfigError, match=r"sync\.codec\.name=fp8 has no delta; it is a parameter"):
        load_config(None, ["sync.codec=fp8", "sync.codec.delta=true"])
    term = load_config(None, ["reward.terms=[{name: numeric_match, position: last}]"]).reward
    assert term.terms[0].params() == {"position": "last"}


def test_a_harness_is_a_command_or_the_users_function_with_its_own_params():
    assert load_config(None).agent.harness.name == "none"
    h = load_config(None, ["agent.harness.command=[python, a.py]"]).agent.harness
    assert (h.name, h.command, h.user) == ("command", ["python", "a.py"], "session")
    fn = "rlpost.envs.examples.calc_agent:run"
    h = load_config(
        None, [f"agent.harness.name={fn}", "agent.harness.workers=2", "agent.harness.tries=3"]
    ).agent.harness
    assert (h.workers, h.params()) == (2, {"tries": 3})  # the shared knobs are not its params
    with pytest.raises(ConfigError, match=r"^config agent\.harness\.name=nope\.py:run: no file"):
        load_config(None, ["agent.harness.name=nope.py:run"])


def test_naming_another_harness_keeps_the_recipes_session_knobs():
    fn = "rlpost.envs.examples.calc_agent:demonstration"
    h = load_config("agent_blackbox", [f"agent.harness.name={fn}"]).agent.harness
    assert (h.name, h.max_requests, h.workers, h.params()) == (fn, 3, 32, {})
    assert h.chat_template.startswith("{%- if tools %}")
