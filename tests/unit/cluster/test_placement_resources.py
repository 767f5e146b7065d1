"""Custom Ray resources in ``cluster.<role>.resources`` go into each worker's bundle."""

from __future__ import annotations

import pytest

from rlpost.cluster.ray_backend import _knobs, plan
from rlpost.config import ConfigError, load_config


def test_custom_resources_go_into_every_bundle_of_their_role():
    cfg = load_config(
        None,
        [
            "cluster.rollout_workers=2",
            "cluster.trainer.resources={trainer_node: 1}",
            "cluster.rollout.resources={rollout_node: 0.5}",
        ],
    )
    groups = {role: bundles for role, bundles, _ in plan(cfg)}
    assert groups["trainer"] == [{"CPU": 1.0, "trainer_node": 1.0}]
    assert groups["rollout"] == [{"CPU": 0.5, "rollout_node": 0.5}] * 2
    assert _knobs("rollout", "rollout_node") == (
        "cluster.rollout.resources.rollout_node or cluster.rollout_workers"
    )


def test_colocated_bundles_hold_both_roles_resources():
    cfg = load_config(
        None,
        [
            "cluster.placement=colocated",
            "cluster.trainer.resources={node_a: 1}",
            "cluster.rollout.resources={node_a: 1, fast: 2}",
        ],
    )
    [(_, bundles, _)] = [g for g in plan(cfg) if g[0] == "trainer+rollout"]
    assert bundles == [{"CPU": 1.5, "node_a": 2.0, "fast": 2.0}]


@pytest.mark.parametrize("value", ["{CPU: 1}", "{GPU: 1}", "{x: 0}"])
def test_ray_own_or_empty_resources_are_refused_in_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"cluster.trainer.resources={value}"])
    assert "cluster.trainer.resources" in str(err.value) and "\n" not in str(err.value)


def test_every_ray_actor_role_names_a_worker_factory():
    """Actors build their worker by name (``<role>_factory`` in cluster.process)."""
    from rlpost.cluster import process
    from rlpost.cluster.ray_backend import _ACTORS

    for role in _ACTORS:
        assert callable(getattr(process, f"{role}_factory", None)), role
