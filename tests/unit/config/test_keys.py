"""``rlpost config RECIPE --keys`` lists the chosen parts' keys, for every shipped recipe."""

from __future__ import annotations

import pytest

from rlpost.cli import main
from rlpost.config import shipped_recipes


def _keys(capsys, *args: str) -> list[str]:
    assert main(["config", *args, "--keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    return [line.split(" = ")[0] for line in out if " = " in line and not line.startswith(" ")]


def test_the_default_recipe_lists_only_the_chosen_parts_keys(capsys):
    keys = _keys(capsys, "grpo_arith")
    assert len(keys) <= 135
    for unread in ("critic.optim.lr", "agent.format", "cluster.address", "model.lora.alpha",
                   "model.teacher.api_key", "sync.bucket_mb", "rollout.partial_fraction"):  # fmt: skip
        assert unread not in keys
    for read in ("algo.loss.clip_low", "cluster.backend", "model.lora.rank", "agent.env.name"):
        assert read in keys
    with_critic = _keys(capsys, "grpo_arith", "algo.advantage=gae", "cluster.backend=ray")
    assert "critic.optim.lr" in with_critic and "cluster.address" in with_critic


@pytest.mark.parametrize("recipe", [r.stem for r in shipped_recipes()])
def test_every_recipe_lists_its_keys_with_no_other_argument(capsys, recipe):
    assert len(_keys(capsys, recipe)) > 50
