"""A real Prometheus server scrapes a Recorder endpoint and serves the values back."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlpost.observe.metrics import ALL_NAMES, METRICS, exposed_sample_name
from rlpost.observe.recorder import Recorder
from tests.integration.prom_util import (
    NO_PROMETHEUS,
    PROMETHEUS,
    running_prometheus,
    value_of,
    wait_for,
    write_config,
)

pytestmark = [
    pytest.mark.promtool,
    pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS),
]


def fake_step(step: int) -> dict[str, float]:
    return {
        "reward_mean": 0.25 * step,
        "reward_std": 0.1,
        "kl": 0.02 * step,
        "response_length_mean": 40.0 + step,
        "clip_frac": 0.05,
        "rollout_tps": 1200.0,
        "mfu": 0.08,
        "sync_seconds": 0.02,
        "rollout_utilization": 0.6,
        "train_utilization": 0.4,
        "sample_lag": 0.5,
        "sample_drop_ratio": 0.0,
        "loss": 1.0,
    }


def test_recorder_endpoint_exposes_every_name_with_sane_values(tmp_path):
    with Recorder(tmp_path, prometheus_port=0) as rec:
        for step in (1, 2, 3):
            rec.record(step, fake_step(step))
        rec.count_guard("kl_explosion")
        with urllib.request.urlopen(f"http://127.0.0.1:{rec.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "le" not in s.labels
    }
    for spec in METRICS:
        value = samples[exposed_sample_name(spec)]
        assert math.isfinite(value) and value >= 0, spec.name
    assert samples["rl_step_total"] == 3
    assert samples["rl_reward_mean"] == 0.75
    assert samples["rl_weight_sync_duration_seconds_count"] == 3
    assert samples["rl_guard_actions_total"] == 1
    for key in ("rl_ratio_clip_frac", "rl_train_mfu", "rl_sample_drop_ratio"):
        assert 0 <= samples[key] <= 1
    assert not any(name.startswith("rl_loss") for name in samples)


def test_prometheus_scrapes_the_recorder_and_answers_queries(tmp_path):
    with Recorder(tmp_path / "run", prometheus_port=0) as rec:
        for step in (1, 2, 3):
            rec.record(step, fake_step(step))
        rec.count_guard("reward_collapse")
        config = write_config(tmp_path / "prometheus.yml", [f"127.0.0.1:{rec.port}"])
        with running_prometheus(config, tmp_path) as prom:
            result = wait_for(prom, 'rl_reward_mean{job="rlpost"}', lambda r: value_of(r) == 0.75)
            assert result[0]["metric"]["instance"] == f"127.0.0.1:{rec.port}"
            assert value_of(wait_for(prom, "rl_step_total", lambda r: len(r) == 1)) == 3
            names = wait_for(
                prom, 'group by (__name__) ({__name__=~"rl_.+"})', lambda r: len(r) >= 15
            )
            scraped = {item["metric"]["__name__"] for item in names}
            for name in ALL_NAMES:
                assert any(s == name or s.startswith(name + "_") for s in scraped), name
            guard = wait_for(
                prom, 'rl_guard_actions_total{guard="reward_collapse"}', lambda r: len(r) == 1
            )
            assert value_of(guard) == 1
