"""Ray backend cases; run by test_ray_backend.py inside a network namespace with only
loopback (one Ray cluster for the whole module, CPU resources only)."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import torch

ray = pytest.importorskip("ray")

from rlpost.cluster.ray_backend import PlacementError, RewardPool, start_ray_workers  # noqa: E402
from rlpost.config import load_config  # noqa: E402
from rlpost.pipeline.loop import train  # noqa: E402
from tests.conftest import small_overrides  # noqa: E402
from tests.fleet_util import await_serving, keeping  # noqa: E402

CPUS = 4


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One Ray cluster for every case (ray.cluster_utils.Cluster: the node-death case adds a
    node and removes it); node deaths are noticed within seconds."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": CPUS,
            "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(autouse=True)
def all_cpus_free_first(cluster):
    """Each case starts on an idle cluster: what the case before it placed is released
    asynchronously, and a placement check would otherwise see it as taken."""
    _all_cpus_free()


def _cfg(tmp_path, **extra):
    over = {"cluster.backend": "ray", "cluster.rollout_workers": 2, "run.threads": 1, **extra}
    return load_config(None, small_overrides(tmp_path, **over))


def _events(run_dir):
    return [json.loads(x) for x in (run_dir / "cluster_events.jsonl").read_text().splitlines()]


def test_every_ray_process_listens_on_loopback_only():
    ray.get(ray.remote(lambda: 1).remote())
    found = 0
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ray" not in cmd and "raylet" not in (proc.info["name"] or ""):
            continue
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found += 1
                assert c.laddr.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1"), (proc.info, c)
    assert found > 0


def test_sigkill_of_a_rollout_actor_mid_run(tmp_path):
    cfg = _cfg(tmp_path, **{"train.steps": 5, "eval.every": 0})
    held, start = keeping(start_ray_workers)
    per_step, pids, served = {}, [], []

    def on_groups(step, groups):
        per_step[step] = [g.prompt.text for g in groups]
        fleet = held[0].rollout
        if step == 2:
            pids.append(fleet.members[0].handle.pid)
            os.kill(pids[0], signal.SIGKILL)
        if step == 4:
            await_serving(fleet, 0, 240)
            served.append(fleet.members[0].served)
            pids.append(fleet.members[0].handle.pid)

    result = train(cfg, start=start, on_groups=on_groups)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5]
    for step, texts in per_step.items():
        assert len(texts) == cfg.rollout.prompts_per_step == len(set(texts)), step
    assert all(h["completions"] == cfg.batch_size for h in result.history)
    rows = [r for r in _events(result.run_dir) if r["worker"] == 0]
    states = [r["state"] for r in rows]
    dead = states.index("dead")
    assert states[dead : dead + 4] == ["dead", "restarting", "stale", "healthy"]
    back = rows[dead + 3]
    assert back["version"] == back["current"] >= 2  # synced before it served
    assert pids[1] != pids[0]  # Ray restarted the actor in a new process
    assert held[0].rollout.members[0].served > served[0]


def test_unsatisfiable_placement_fails_fast_in_one_line(tmp_path):
    cases = [
        ({"cluster.trainer.gpus": 1}, ("trainer", "GPU 1")),
        ({"cluster.rollout.cpus": CPUS}, ("rollout", "CPU 8")),
    ]
    for k, (extra, words) in enumerate(cases):
        cfg = _cfg(tmp_path, **{"cluster.placement_timeout_s": 30, "run.name": f"p{k}", **extra})
        with pytest.raises(PlacementError) as err:
            train(cfg, start=start_ray_workers)
        message = str(err.value)
        assert "\n" not in message and all(w in message for w in words), message
        _all_cpus_free()  # nothing left placed


def _all_cpus_free(timeout=30.0):
    """Ray reports freed resources a moment later: wait for them, then insist."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU") != CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == CPUS, ray.available_resources()


def test_a_placement_group_ray_cannot_place_times_out_in_one_line(tmp_path, monkeypatch):
    from rlpost.cluster import ray_backend

    # the pre-check would refuse this at once; without it Ray itself must never place it
    monkeypatch.setattr(ray_backend, "check_fits", lambda *a, **k: None)
    cfg = _cfg(tmp_path, **{"cluster.rollout.cpus": CPUS, "cluster.placement_timeout_s": 3})
    with pytest.raises(PlacementError) as err:
        train(cfg, start=start_ray_workers)
    message = str(err.value)
    assert "\n" not in message and "rollout placement group" in message, message
    assert "not placed within 3 s" in message
    _all_cpus_free()


def test_sigterm_to_the_trainer_actor_checkpoints_and_stops_then_resumes(tmp_path):
    from rlpost.pipeline.interrupts import Interrupts
    from rlpost.train.checkpoint import latest_checkpoint, latest_step

    cfg = _cfg(tmp_path, **{"train.steps": 6, "eval.every": 0, "checkpoint.every": 0})
    held, start = keeping(start_ray_workers)

    with Interrupts() as interrupts:

        def on_groups(step, groups):
            if step == 2:  # the notice reaches the driver, which stops after this step
                os.kill(held[0].trainer.pid, signal.SIGTERM)
                assert interrupts.stop.wait(60)

        first = train(cfg, start=start, on_groups=on_groups, stop=interrupts.stop)
    assert [h["step"] for h in first.history] == [1, 2]
    assert latest_step(latest_checkpoint(first.run_dir)) == 2  # saved by the noticed trainer
    rest = train(cfg, resume=first.run_dir, start=start_ray_workers)
    assert [h["step"] for h in rest.history] == [3, 4, 5, 6]


def test_colocated_placement_with_reward_workers_runs(tmp_path):
    cfg = _cfg(
        tmp_path,
        **{
            "train.steps": 2,
            "eval.every": 0,
            "cluster.placement": "colocated",
            "cluster.reward_workers": 2,
        },
    )
    held: list = []
    groups_seen: list = []

    def start(*args, **kwargs):
        held.append(start_ray_workers(*args, **kwargs))
        table = ray.util.placement_group_table()
        names = {v["name"]: v for v in table.values() if v["state"] == "CREATED"}
        groups_seen.append(sorted(names))
        return held[-1]

    counters: list = []
    result = train(
        cfg, start=start, on_groups=lambda s, g: counters.append(held[0].reward.counters())
    )
    assert [h["step"] for h in result.history] == [1, 2]
    trainer_group = [n for n in groups_seen[0] if n.endswith("-trainer+rollout")]
    assert trainer_group and not any(n.endswith("-rollout") for n in groups_seen[0])
    assert any(n.endswith("-reward") for n in groups_seen[0])
    assert isinstance(held[0].reward, RewardPool) and counters  # scored by the reward actors
    _all_cpus_free()


def test_a_lost_node_takes_a_rollout_worker_and_the_run_goes_on(tmp_path, cluster):
    """A second node holds one rollout worker (the trainer needs more CPUs than it has); the
    node is removed mid-run; Ray reschedules the bundle, restarts the actor, the fleet syncs it."""
    spot = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    cfg = _cfg(
        tmp_path,
        **{
            "train.steps": 5,
            "eval.every": 0,
            "cluster.trainer.cpus": 2,
            "cluster.rollout.cpus": 1,
        },
    )
    held, start = keeping(start_ray_workers)
    per_step, lost, after = {}, [], []

    def on_groups(step, groups):
        per_step[step] = [g.prompt.text for g in groups]
        fleet = held[0].rollout
        if step == 2:
            nodes = [m.handle.node for m in fleet.members]
            assert held[0].trainer.node != spot.node_id
            assert spot.node_id in nodes, "SPREAD placed no rollout worker on the second node"
            lost.append(nodes.index(spot.node_id))
            pid = fleet.members[lost[0]].handle.pid
            # a lost machine takes its processes with it: the raylet and the actor's worker
            # (removing the node alone kills Ray's daemons and leaves the worker answering)
            cluster.remove_node(spot, allow_graceful=False)
            os.kill(pid, signal.SIGKILL)
        if step == 4:
            await_serving(fleet, lost[0], 240)
        if step == 5:  # after step 4's weights went out
            back = fleet.members[lost[0]].handle
            after.append((back.node, back.version(), fleet.version()))

    result = train(cfg, start=start, on_groups=on_groups)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5]
    for step, texts in per_step.items():
        assert len(texts) == cfg.rollout.prompts_per_step == len(set(texts)), step
    rows = [r for r in _events(result.run_dir) if r["worker"] == lost[0]]
    states = [r["state"] for r in rows]
    node, version, current = after[0]
    assert node != spot.node_id and version == current  # rescheduled, and holds the newest
    # the fleet saw it go (a call failed: dead, restarting), or Ray had it back between calls
    # and its next call was refused for holding old weights (stale); either way it was synced
    # in full before it served again
    first = states.index("healthy")  # admitted at the run's first weights
    gone = next(i for i in range(first + 1, len(states)) if states[i] in ("dead", "stale"))
    assert "healthy" in states[gone:]
    back = states.index("healthy", gone)
    assert rows[back]["version"] == rows[back]["current"]


@pytest.mark.parametrize(
    "layout",
    [
        {"cluster.tensor_parallel": 2},
        {"cluster.pipeline_parallel": 2},
        {"cluster.tensor_parallel": 2, "cluster.pipeline_parallel": 2},
    ],
    ids=["tp2", "pp2", "pp2xtp2"],
)
def test_model_parallel_trainers_train_as_ray_actors(tmp_path, layout):
    """Trainer actors splitting the model (each layer's heads, the layers into two stages,
    or both) train a run; every checkpoint gathers every rank's parts, and each of the two
    layers changed from one step's checkpoint to the next."""
    from rlpost.models.loading import load_causal_lm

    ranks = layout.get("cluster.tensor_parallel", 1) * layout.get("cluster.pipeline_parallel", 1)
    over = {"train.steps": 2, "eval.every": 0, "cluster.trainer_workers": ranks, **layout}
    over["cluster.trainer.cpus"] = 2 / ranks  # the ranks' bundles fit the cluster's 4 CPUs
    spread = "[{name: 'tests.integration.knob_probe:spread_reward'}]"  # advantages not all 0
    more = {"model.tiny.num_key_value_heads": 2, "reward.terms": spread}
    more["rollout.truncated_reward"] = "null"
    cfg = _cfg(tmp_path, **over, **more)
    result = train(cfg)
    assert [h["step"] for h in result.history] == [1, 2]
    steps = [load_causal_lm(result.run_dir / "checkpoints" / f"step_{s}" / "model") for s in (1, 2)]
    one, two = (dict(m.named_parameters()) for m in steps)
    for layer in range(cfg.model.tiny.num_hidden_layers):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert not torch.equal(one[name], two[name]), name
    _all_cpus_free()
