"""Finding things: near-miss keys, recipe values, shipped recipes, rewards, generated docs (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.cli import main
from rlpost.config import ConfigError, load_config, shipped_recipes
from rlpost.configdoc import render

DOCS = Path(__file__).resolve().parents[3] / "docs"


def test_unknown_key_suggests_the_nearest(capsys):
    with pytest.raises(ConfigError, match=r"'data.prompt_feld'; did you mean data.prompt_template"):
        load_config(None, ["data.prompt_feld=q"])
    with pytest.raises(ConfigError, match=r"did you mean rollout.temperature"):
        load_config(None, ["train.temperature=0.5"])
    with pytest.raises(ConfigError, match=r"'rolout'; did you mean rollout\?"):
        load_config(None, ["rolout.n=2"])


def test_config_keys_shows_the_recipes_values(capsys):
    assert main(["config", "dapo_arith", "--keys", "rollout.n=5"]) == 0
    out = capsys.readouterr().out
    assert "run.name = 'dapo_arith'\n" in out and "rollout.n = 5\n" in out
    assert "algo.dynamic_sampling = True\n" in out
    assert "reward.terms = [{'name': 'numeric_match'" in out


def test_shipped_recipes_work_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    names = [p.stem for p in shipped_recipes()]
    assert {"grpo_arith", "dapo_arith", "dpo_prefs", "grpo_file"} <= set(names)
    for spelling in ("dapo_arith", "dapo_arith.yaml", "recipes/dapo_arith.yaml"):
        assert load_config(spelling).run.name == "dapo_arith"
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: grpo_arith.yaml\nrun: {name: mine}\n")
    cfg = load_config(mine)
    assert cfg.run.name == "mine" and cfg.sft.steps == 2000  # the rest from the shipped recipe
    with pytest.raises(ConfigError, match="did you mean dapo_arith"):
        load_config("dapo_arth")
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in names)


def test_rewards_are_listed_with_their_parameters(capsys):
    assert main(["rewards"]) == 0
    out = capsys.readouterr().out
    assert "numeric_match (per-sample)" in out and "position='first'" in out
    assert "math_verify" in out


@pytest.mark.parametrize("doc", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_generated_config_tables_match_the_config(doc):
    text = doc.read_text()
    assert render(text) == text, f"run: python -m rlpost.configdoc {doc}"
