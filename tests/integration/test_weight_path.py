"""Every push goes through the run's weight path: a guard's re-send in one_step_off waits for
the batch in flight, so no trained batch (and no sample) mixes policy versions; the disk
channel works from ``rlpost train``, and the channels it cannot drive fail in one line (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


def _rlpost(*args: str, cwd=None) -> subprocess.CompletedProcess:
    code = "import sys; from rlpost.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900, cwd=cwd
    )


def test_disk_channel_from_rlpost_train_publishes_versions_the_workers_load(tmp_path):
    """The trainer publishes each version under RUN_DIR/weights; the rollout worker, in its
    own process, loads it from there (checksums checked) and samples with it."""
    args = [
        "train",
        f"run.output_dir={tmp_path}",
        "run.name=disk",
        "run.threads=1",
        "sft.steps=5",
        "train.steps=3",
        "rollout.prompts_per_step=4",
        "rollout.n=2",
        "rollout.max_tokens=4",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "eval.limit=4",
        "eval.every=0",
        "checkpoint.every=0",
        "observe.progress=false",
        "observe.plot=false",
        "cluster.backend=process",
        "sync.channel=disk",
        "sync.codec=bf16",
    ]
    done = _rlpost(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "disk"
    weights = run / "weights"
    assert (weights / "LATEST").read_text() == "3"  # the last step's version, published last
    assert sorted(p.name for p in weights.glob("v*")) == ["v0000000002", "v0000000003"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["policy_version"] for r in steps] == [0, 1, 2]
    assert all(r["sample_lag"] == 0.0 for r in steps)  # every step sampled the newest version
    published = sum(p.stat().st_size for p in (weights / "v0000000003").glob("bucket-*"))
    # the bucket payload (bf16) is what the step reports; the files add small headers
    assert 0.9 * published < steps[-1]["sync_bytes"] <= published


@pytest.mark.parametrize("channel", ["gloo", "vllm"])
def test_channels_rlpost_train_cannot_drive_fail_in_one_line(tmp_path, channel):
    done = _rlpost("train", f"run.output_dir={tmp_path}", f"sync.channel={channel}")
    assert done.returncode != 0
    lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and f"sync.channel={channel}" in lines[0], done.stderr
    assert "(inprocess)" in lines[0] and "(disk)" in lines[0] and "(http" in lines[0]
