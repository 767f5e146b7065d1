"""Every push goes through the run's weight path: a guard's re-send in one_step_off waits for
the batch in flight, so no trained batch (and no sample) mixes policy versions (CPU)."""

from __future__ import annotations

from rlpost.config import load_config
from rlpost.observe import guards
from rlpost.pipeline.loop import train


def _cfg(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.threads=1",
            "sft.steps=0",  # an untrained policy runs to max_tokens: long batches
            "train.steps=5",
            "rollout.prompts_per_step=8",
            "rollout.n=2",
            "rollout.max_tokens=24",
            "rollout.batch_size=2",  # one prompt per engine call: a batch is many calls
            "train.mini_batch_size=16",
            "train.micro_batch_size=16",
            "eval.limit=4",
            "eval.every=0",
            "checkpoint.every=0",
            "observe.progress=false",
            "observe.plot=false",
            "cluster.backend=local",
            *extra,
        ],
    )


def test_guard_resend_in_one_step_off_mixes_no_versions(tmp_path, monkeypatch):
    after_step = guards.Guards.after_step
    resent: list[int] = []

    def resend_every_step(self, metrics):  # the throughput guard's action, on every step
        resent.append(1)
        rebuild = guards.Action("throughput_decay", "rebuild_engine", None, "test re-send")
        return [*after_step(self, metrics), rebuild]

    monkeypatch.setattr(guards.Guards, "after_step", resend_every_step)
    batches: dict[int, list[list[int]]] = {}

    def record(step, groups):
        batches[step] = [c.versions_per_token() for g in groups for c in g.completions]

    result = train(_cfg(tmp_path, "resend", "pipeline.mode=one_step_off"), on_groups=record)
    assert len(resent) == 5 and len(batches) == 5
    for step, rows in batches.items():
        assert all(len(set(row)) == 1 for row in rows), f"step {step}: a sample mixes versions"
        versions = {row[0] for row in rows}
        assert len(versions) == 1, f"step {step}: one batch sampled {sorted(versions)}"
        # one step off: batch k (trained at step k, weights k-1) sampled version k-2 or k-1
        assert step - 2 <= versions.pop() <= step - 1
    assert [h["policy_version"] for h in result.history][:1] == [0]
