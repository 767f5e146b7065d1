"""A fleet of rollout workers in OS processes survives a worker killed mid-run (CPU).

Real processes, real SIGKILL and SIGTERM: the step completes on the other
worker with every prompt answered exactly once, the lost worker is restarted
and serves again only after it reported the current weight version.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from rlpost.cluster.fleet import RolloutFleet
from rlpost.cluster.health import HealthPolicy
from rlpost.cluster.process import ProcessSpawner, start_process_workers
from rlpost.config import ConfigError, load_config
from rlpost.pipeline import build
from rlpost.pipeline.loop import train
from rlpost.types import Prompt
from tests.conftest import small_overrides
from tests.fleet_util import await_serving, keeping


def _cfg(tmp_path, **extra):
    over = {
        "cluster.backend": "process",
        "cluster.rollout_workers": 2,
        "run.threads": 1,
        "train.steps": 4,
        **extra,
    }
    return load_config(None, small_overrides(tmp_path, **over))


def _events(run_dir):
    path = run_dir / "cluster_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_of_a_rollout_process_mid_run_loses_no_prompt(tmp_path):
    cfg = _cfg(tmp_path, **{"train.steps": 5, "eval.every": 0})
    held, start = keeping(start_process_workers)
    per_step: dict[int, list[str]] = {}
    served: list[int] = []

    def on_groups(step, groups):
        per_step[step] = [g.prompt.text for g in groups]
        fleet = held[0].rollout
        if step == 2:  # the weights of step 2 go to a dead worker; step 3 runs without it
            os.kill(fleet.members[0].handle.pid, signal.SIGKILL)
        if step == 4:  # let the restart finish: step 5 is served by both again
            await_serving(fleet, 0, 240)
            served.append(fleet.members[0].served)

    result = train(cfg, start=start, on_groups=on_groups)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5]
    for step, texts in per_step.items():  # every step trained its full batch, each prompt once
        assert len(texts) == cfg.rollout.prompts_per_step == len(set(texts)), step
    assert all(h["completions"] == cfg.batch_size for h in result.history)
    rows = [r for r in _events(result.run_dir) if r["worker"] == 0]
    states = [r["state"] for r in rows]
    assert states[:2] == ["stale", "healthy"]
    dead = states.index("dead")
    assert states[dead : dead + 4] == ["dead", "restarting", "stale", "healthy"]
    back = rows[dead + 3]
    # admitted only once it reported the version the fleet serves at that moment
    assert back["version"] == back["current"] >= 2
    assert "code -9" in rows[dead]["why"]
    # and it served the last step's share after its return
    assert held[0].rollout.members[0].served > served[0]


def _fleet(tmp_path, **extra):
    cfg = _cfg(tmp_path, **{"rollout.max_tokens": 12, **extra})
    model, _ = build.build_policy(cfg)
    fleet = RolloutFleet(
        ProcessSpawner(cfg, tmp_path),
        2,
        policy=HealthPolicy(max_restarts=2),
        events=tmp_path / "cluster_events.jsonl",
    )
    fleet.load_weights(model.named_parameters(), 1)
    return cfg, model, fleet


def _prompts(k):
    return [Prompt(f"{i % 9}+{i % 7}=", answer=str(i % 9 + i % 7)) for i in range(k)]


def _busy(member, timeout=60.0):
    deadline = time.monotonic() + timeout
    while member.health.busy_since is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _signal_mid_generate(fleet, prompts, params, index: int, sig: int):
    """``fleet.generate(prompts, params, 4)``, with ``sig`` sent to worker ``index`` once it
    is busy with its share."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fleet.generate(prompts, params, 4)))
    t.start()
    _busy(fleet.members[index])
    os.kill(fleet.members[index].handle.pid, sig)
    t.join(timeout=300)
    return out[0]


def test_a_worker_killed_during_generate_has_its_prompts_resent(tmp_path):
    cfg, model, fleet = _fleet(tmp_path)
    try:
        prompts = _prompts(48)
        params = build.sampling_params(cfg, eos_token_id=0)
        groups = _signal_mid_generate(fleet, prompts, params, 1, signal.SIGKILL).groups
        assert [g.prompt.text for g in groups] == [p.text for p in prompts]  # once, in order
        assert all(g.n == 4 for g in groups)
        rows = _events(tmp_path)
        assert any(r["worker"] == 1 and r["state"] == "dead" for r in rows)
        # restarted and readmitted at the version the fleet serves, then new weights reach it
        await_serving(fleet, 1, 120)
        assert fleet.members[1].handle.version() == 1
        fleet.load_weights(model.named_parameters(), 2)
        assert [m.handle.version() for m in fleet.members] == [2, 2]
        again = fleet.generate(prompts[:6], params, 2)
        assert [g.prompt.text for g in again.groups] == [p.text for p in prompts[:6]]
    finally:
        fleet.close()


@pytest.mark.slow
def test_sigterm_drains_a_worker_and_it_comes_back_synced(tmp_path):
    cfg, _, fleet = _fleet(tmp_path)
    try:
        prompts = _prompts(32)
        params = build.sampling_params(cfg, eos_token_id=0)
        old = fleet.members[0].handle
        out = _signal_mid_generate(fleet, prompts, params, 0, signal.SIGTERM)
        assert [g.prompt.text for g in out.groups] == [p.text for p in prompts]
        # it finished its running call, then left on its own; the handle's pipe reader reaps
        # it too, and a join racing that reap can return before the exit code is recorded
        deadline = time.monotonic() + 60
        while old._proc.exitcode is None and time.monotonic() < deadline:
            old._proc.join(timeout=0.5)
        assert old._proc.exitcode == 0, (old._proc.exitcode, fleet.states())
        again = fleet.generate(prompts, params, 1)  # finds it gone, re-sends, restarts it
        assert [g.prompt.text for g in again.groups] == [p.text for p in prompts]
        await_serving(fleet, 0, 120)
        assert fleet.members[0].handle is not old and fleet.members[0].handle.version() == 1
    finally:
        fleet.close()


def test_fleet_settings_it_cannot_honour_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.partial"):
        train(_cfg(tmp_path, **{"rollout.partial": True}), start=start_process_workers)


@pytest.mark.slow
def test_scale_a_running_job_up_and_down_from_the_command_line(tmp_path, capsys):
    from rlpost.cli import main

    cfg = _cfg(tmp_path, **{"train.steps": 6, "eval.every": 0})
    held, start = keeping(start_process_workers)
    per_step: dict[int, int] = {}
    answers: list[int] = []

    def on_groups(step, groups):
        per_step[step] = len(groups)
        run_dir = str(cfg.run_dir)
        if step == 2:  # the command waits for the job's answer: the new worker is synced
            answers.append(main(["cluster", "scale", "--rollout", "3", run_dir, "--wait", "240"]))
            assert [m.health.state.value for m in held[0].rollout.members] == ["healthy"] * 3
        if step == 4:
            answers.append(main(["cluster", "scale", "--rollout", "1", run_dir, "--wait", "240"]))

    result = train(cfg, start=start, on_groups=on_groups)
    assert answers == [0, 0]
    out = capsys.readouterr().out
    assert "3 rollout workers healthy" in out and "1 rollout workers healthy" in out
    assert per_step == {s: cfg.rollout.prompts_per_step for s in range(1, 7)}
    rows = _events(result.run_dir)
    new = [r for r in rows if r["worker"] == 2]
    assert [r["state"] for r in new] == ["stale", "healthy", "retired"]
    assert new[1]["version"] == new[1]["current"] >= 1  # synced to the weights of the moment
    fleet = held[0].rollout
    assert fleet.members[2].served > 0  # it served step 3 and 4's prompts
    assert [m.health.state.value for m in fleet.members] == ["healthy", "retired", "retired"]
    assert main(["cluster", "scale", "--rollout", "0", str(result.run_dir)]) == 2
    assert main(["cluster", "scale", "--rollout", "2", str(result.run_dir)]) == 2  # ended
    capsys.readouterr()
    assert main(["cluster", "status", str(result.run_dir)]) == 0
    last = capsys.readouterr().out.strip()
    assert "1 rollout workers healthy" in last and last.endswith("(the job has ended)")
