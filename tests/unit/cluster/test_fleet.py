"""The rollout fleet's bookkeeping with in-process rollout workers (CPU, no processes):
shares, order, weights to every worker, admission, saved state. Losing a worker is
tested with real processes in tests/integration/test_fleet_process.py."""

from __future__ import annotations

import json

import torch

from rlpost.cluster.fleet import Chunk, RolloutFleet, _merge_stats, _split
from rlpost.cluster.process import slot_config
from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.types import Prompt
from tests.conftest import small_overrides


class LocalSpawner:
    """Real rollout workers in this process (what a laptop without processes would run)."""

    def __init__(self, cfg) -> None:
        self.cfg, self.started = cfg, []

    def start(self, index, old=None):
        self.started.append(index)
        return build.build_rollout_worker(slot_config(self.cfg, index, len(self.started)))

    def alive(self, handle) -> bool:
        return True

    def stop(self, handle) -> None:
        handle.close()


def _prompts(k):
    return [Prompt(f"{i}+1=", answer=str(i + 1)) for i in range(k)]


def test_split_keeps_order_and_sizes():
    prompts = _prompts(7)
    parts = _split([Chunk(0, prompts)], 3)
    assert [len(c.prompts) for c in parts] == [3, 2, 2]
    assert [c.start for c in parts] == [0, 3, 5]
    # a re-sent share with a gap is cut into contiguous runs, each knowing where it started
    resent = _split([Chunk(0, prompts[:2]), Chunk(5, prompts[5:])], 1)
    assert [(c.start, [p.text for p in c.prompts]) for c in resent] == [
        (0, ["0+1=", "1+1="]),
        (5, ["5+1=", "6+1="]),
    ]
    assert len(_split([Chunk(0, prompts[:2])], 5)) == 2  # never an empty share


def test_merge_stats_adds_counts_and_averages_fractions():
    out = _merge_stats(
        [
            {"carried_groups": 2.0, "partial_done_fraction": 0.5},
            {"carried_groups": 3.0, "partial_done_fraction": 1.0},
        ]
    )
    assert out == {"carried_groups": 5.0, "partial_done_fraction": 0.75}


def test_fleet_of_local_workers_serves_in_order_after_its_first_sync(tmp_path):
    cfg = load_config(None, small_overrides(tmp_path, **{"rollout.max_tokens": 3}))
    model, _ = build.build_policy(cfg)
    spawner = LocalSpawner(cfg)
    fleet = RolloutFleet(spawner, 2, events=tmp_path / "events.jsonl")
    try:
        assert fleet.states() == ["stale", "stale"]  # nothing served before weights arrive
        fleet.load_weights(model.named_parameters(), 3)
        assert fleet.states() == ["healthy", "healthy"] and fleet.version() == 3
        assert [m.handle.version() for m in fleet.members] == [3, 3]
        # the fleet keeps its own copy: later changes to the trainer's tensors do not leak
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        kept = fleet._latest[0][0][1]
        assert not torch.equal(kept, next(model.parameters()))
        prompts = _prompts(5)
        params = build.sampling_params(cfg, eos_token_id=0)
        out = fleet.generate(prompts, params, 2)
        assert [g.prompt.text for g in out.groups] == [p.text for p in prompts]
        assert [m.served for m in fleet.members] == [3, 2]
        assert {v for g in out.groups for c in g.completions for v in c.versions_per_token()} == {3}
        state = fleet.state_dict()
        assert sorted(state["fleet"]) == [0, 1]
        fleet.load_state_dict(state)  # a resume gives each slot its own state back
        assert fleet.generate([], params, 2).groups == []
        fleet.scale(1)
        assert fleet.states() == ["healthy", "retired"]
        assert len(fleet.generate(prompts, params, 1).groups) == 5
        assert fleet.members[1].served == 2
    finally:
        fleet.close()


def test_a_worker_restarted_behind_the_fleets_back_is_synced_before_it_serves(tmp_path):
    """A host (Ray) may restart a worker between calls: it comes back at version 0. Its next
    call is refused, it is synced in full, its share is re-sent, and no token is sampled from
    the old weights."""
    cfg = load_config(None, small_overrides(tmp_path, **{"rollout.max_tokens": 3}))
    model, _ = build.build_policy(cfg)
    spawner = LocalSpawner(cfg)
    events = tmp_path / "events.jsonl"
    fleet = RolloutFleet(spawner, 2, events=events)
    try:
        fleet.load_weights(model.named_parameters(), 4)
        fresh = spawner.start(1)  # what the host put in the slot: never sent any weights
        assert fresh.version() == 0
        fleet.members[1].handle.close()
        fleet.members[1].handle = fresh
        prompts = _prompts(6)
        out = fleet.generate(prompts, build.sampling_params(cfg, eos_token_id=0), 2)
        assert [g.prompt.text for g in out.groups] == [p.text for p in prompts]
        assert {v for g in out.groups for c in g.completions for v in c.versions_per_token()} == {4}
        assert fresh.version() == 4 and fleet.states() == ["healthy", "healthy"]
        rows = [json.loads(x) for x in events.read_text().splitlines()]
        mine = [r["state"] for r in rows if r["worker"] == 1]
        assert mine[-2:] == ["stale", "healthy"]
        assert (
            "holds weights version 0, was sent 4"
            in [r for r in rows if r["worker"] == 1][-2]["why"]
        )
    finally:
        fleet.close()
