"""Guard rules: each fires on its problem, escalates, ends in stop, and stays quiet when healthy."""

from __future__ import annotations

import logging
import math

import pytest
from pydantic import ValidationError

from rlpost.observe.guards import Action, GuardConfig, Guards


def healthy(step: int) -> dict[str, float]:
    """A learning run: rising noisy reward, moderate KL and clipping, steady throughput."""
    wobble = 0.03 * math.sin(step * 1.7)
    return {
        "reward_mean": min(0.9, 0.1 + 0.01 * step) + wobble,
        "kl": 0.5 + 0.2 * math.sin(step),
        "clip_frac": 0.1 + 0.05 * math.sin(step * 0.3),
        "rollout_tps": 1000.0 * (1 + 0.2 * math.sin(step * 2.3)),
    }


def kinds(actions: list[Action]) -> list[str]:
    return [a.kind for a in actions]


def test_quiet_on_a_healthy_series():
    guards = Guards(GuardConfig())
    for step in range(200):
        assert guards.after_step(healthy(step)) == []
        assert guards.check_update(1.5, 0.8) is None
    assert guards.check_rewards([0.0, 1.0, 0.5]) == []


def test_quiet_when_reward_hovers_near_zero():
    guards = Guards(GuardConfig())
    for step in range(100):
        assert guards.after_step({"reward_mean": 0.02 * (step % 3)}) == []


def test_nonfinite_update_is_skipped_then_escalates_to_rollback():
    guards = Guards(GuardConfig(max_retries=2))
    assert guards.check_update(math.nan, 1.0).kind == "skip_update"
    assert guards.check_update(1.0, math.inf).kind == "skip_update"
    action = guards.check_update(math.nan, math.nan)
    assert action.kind == "rollback" and action.guard == "nonfinite_update"
    assert guards.check_update(1.0, 1.0) is None
    assert guards.check_update(math.nan, 1.0).kind == "skip_update"


def test_nonfinite_rewards_are_dropped_by_index():
    assert Guards(GuardConfig()).check_rewards([1.0, math.nan, 0.0, -math.inf]) == [1, 3]


def test_kl_explosion_raises_beta_with_cooldown_then_rolls_back():
    guards = Guards(GuardConfig(kl_ceiling=10.0, kl_beta_factor=2.0, cooldown=2, max_retries=2))
    first = guards.after_step({"kl": 12.0})
    assert first == [Action("kl_explosion", "raise_beta", 2.0, first[0].reason)]
    assert "kl=12" in first[0].reason and "kl_ceiling=10" in first[0].reason
    assert guards.after_step({"kl": 15.0}) == []  # cooling down
    assert guards.after_step({"kl": 15.0}) == []
    assert kinds(guards.after_step({"kl": 15.0})) == ["raise_beta"]
    for _ in range(2):
        guards.after_step({"kl": 15.0})
    assert kinds(guards.after_step({"kl": 15.0})) == ["rollback", "lower_lr"]


def test_clip_fraction_lowers_lr():
    guards = Guards(GuardConfig(clip_frac_ceiling=0.5, lr_factor=0.25))
    assert guards.after_step({"clip_frac": 0.5}) == []
    (action,) = guards.after_step({"clip_frac": 0.8})
    assert (action.guard, action.kind, action.factor) == ("clip_frac", "lower_lr", 0.25)


def test_reward_collapse_rolls_back_and_lowers_lr():
    guards = Guards(GuardConfig(reward_collapse_window=5))
    for _ in range(10):
        assert guards.after_step({"reward_mean": 0.8}) == []
    actions = []
    for _ in range(20):
        actions = guards.after_step({"reward_mean": 0.1})
        if actions:
            break
    assert kinds(actions) == ["rollback", "lower_lr"]
    assert actions[0].guard == "reward_collapse" and actions[1].factor == 0.5


def test_reward_collapse_needs_the_window_to_arm():
    guards = Guards(GuardConfig(reward_collapse_window=8))
    # a bad first batch after a lucky one must not count as collapse
    for reward in (0.9, 0.0, 0.0, 0.1, 0.1, 0.2, 0.2):
        assert guards.after_step({"reward_mean": reward}) == []


def test_repeated_collapse_ends_in_stop_and_never_loops():
    guards = Guards(GuardConfig(reward_collapse_window=3, max_retries=3))
    seen = []
    rewards = [0.8, 0.8, 0.8, 0.8, 0.0, 0.0, 0.0, 0.0] * 50  # every restore collapses again
    for reward in rewards:
        seen += guards.after_step({"reward_mean": reward})
        if guards.stopped:
            break
    assert kinds(seen).count("rollback") == 3
    assert seen[-1].kind == "stop" and "3 rollbacks did not help" in seen[-1].reason
    assert "max_retries=3" in seen[-1].reason
    assert kinds(guards.after_step(healthy(0))) == ["stop"]


def test_throughput_decay_rebuilds_then_only_warns(caplog):
    guards = Guards(GuardConfig(throughput_window=3, throughput_decay=0.5, max_retries=1))
    for _ in range(5):
        assert guards.after_step({"rollout_tps": 1000.0}) == []
    assert guards.after_step({"rollout_tps": 400.0}) == []  # one slow step: median still high
    (rebuild,) = guards.after_step({"rollout_tps": 400.0})
    assert (rebuild.guard, rebuild.kind) == ("throughput_decay", "rebuild_engine")
    assert "median 400 tokens/s < 0.5 x best 1e+03; rebuild 1/1" in rebuild.reason
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert guards.after_step({"rollout_tps": 300.0}) == []
    assert "1 rebuilds spent, continuing" in caplog.text
    assert not guards.stopped
    for _ in range(3):  # recovery resets the budget
        guards.after_step({"rollout_tps": 1000.0})
    acted = [a.kind for _ in range(3) for a in guards.after_step({"rollout_tps": 100.0})]
    assert acted == ["rebuild_engine"]


def test_disabled_guards_never_act():
    guards = Guards(GuardConfig(enabled=False))
    assert guards.check_update(math.nan, math.nan) is None
    assert guards.check_rewards([math.nan]) == []
    assert guards.after_step({"kl": 1e9, "clip_frac": 1.0}) == []


def test_each_action_is_logged_on_one_line(caplog):
    caplog.set_level(logging.WARNING, logger="rlpost.observe.guards")
    Guards(GuardConfig()).after_step({"kl": 99.0})
    (record,) = caplog.records
    assert "guard kl_explosion: raise_beta x2" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_config_forbids_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError, match="kl_celing"):
        GuardConfig(kl_celing=3.0)
    with pytest.raises(ValidationError, match="lr_factor"):
        GuardConfig(lr_factor=1.5)
    assert "Multiply the KL coefficient" in GuardConfig.model_fields["kl_beta_factor"].description
