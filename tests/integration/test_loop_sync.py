"""The loop's weight sync: sync.every leaves the engine on older weights in between (the lag
shows it), and a codec or delta sends fewer bytes through the sync layer (CPU)."""

from __future__ import annotations

import math

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.pipeline.loop import train


def _cfg(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.threads=1",
            "sft.steps=20",
            "train.steps=4",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "rollout.max_tokens=6",
            "train.mini_batch_size=16",
            "train.micro_batch_size=16",
            "eval.limit=4",
            "eval.every=0",
            "observe.progress=false",
            "observe.plot=false",
            *extra,
        ],
    )


def test_sync_every_two_steps_serves_an_older_version_in_between(tmp_path):
    h = train(_cfg(tmp_path, "every", "sync.every=2")).history
    assert [x["sync_bytes"] > 0 for x in h] == [False, True, False, True]
    # weights go out after steps 2 and 4: step 2 samples version 0 while training version 1
    assert h[0]["sample_lag"] == 0.0 and h[1]["sample_lag"] == 1.0
    assert h[2]["sample_lag"] == 0.0 and h[3]["sample_lag"] == 1.0


def test_bf16_delta_through_the_sync_layer_sends_fewer_bytes(tmp_path):
    plain = train(_cfg(tmp_path, "plain")).history
    delta = train(_cfg(tmp_path, "delta", "sync.codec=bf16", "sync.codec.delta=true")).history
    assert all(math.isfinite(x["loss"]) for x in delta)
    assert all(x["sync_version"] == x["step"] for x in delta)
    assert delta[-1]["sync_bytes"] < 0.5 * plain[-1]["sync_bytes"]


def test_channels_the_loop_cannot_drive_are_refused(tmp_path):
    from rlpost.pipeline.rules import check as check_names

    with pytest.raises(ConfigError, match=r"sync\.channel=gloo"):
        check_names(_cfg(tmp_path, "gloo", "sync.channel=gloo"))
