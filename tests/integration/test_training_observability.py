"""Observability of a real training run: scraped live, and guards acting on injected faults."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rlpost.config import load_config
from rlpost.observe.metrics import METRICS, exposed_sample_name
from rlpost.pipeline import build
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides
from tests.integration.prom_util import (
    NO_PROMETHEUS,
    PROMETHEUS,
    free_port,
    running_prometheus,
    value_of,
    wait_for,
    write_config,
)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "le" not in s.labels
    }


def _run_in_thread(cfg):
    stop = threading.Event()
    box: dict = {}

    def target():
        try:
            box["result"] = train(cfg, stop=stop)
        except BaseException as exc:  # surfaced by the test below
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, stop, box


def _wait_for_steps(port: int, steps: float, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            samples = _scrape(port)
        except OSError:  # the endpoint is not up yet: retry until the deadline
            samples = {}
        if samples.get("rl_step_total", 0) >= steps:
            return samples
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach {steps} steps on :{port} in {timeout} s")


def test_live_endpoint_of_a_training_run_has_every_metric(tmp_path):
    port = free_port()
    cfg = load_config(
        None, small_overrides(tmp_path, **{"train.steps": 500, "observe.prometheus.port": port})
    )
    thread, stop, box = _run_in_thread(cfg)
    try:
        samples = _wait_for_steps(port, 3)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert "error" not in box, box.get("error")
    for spec in METRICS:
        value = samples[exposed_sample_name(spec)]
        assert math.isfinite(value) and value >= 0, spec.name
    for key in (
        "rl_reward_mean",
        "rl_ratio_clip_frac",
        "rl_sample_drop_ratio",
        "rl_train_worker_utilization",
    ):
        assert 0 <= samples[key] <= 1, key
    assert samples["rl_rollout_throughput_tps"] > 0
    assert samples["rl_response_length_mean"] > 0
    assert samples["rl_weight_sync_duration_seconds_count"] >= 3


@pytest.mark.promtool
@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_prometheus_scrapes_a_training_run(tmp_path):
    port = free_port()
    cfg = load_config(
        None,
        small_overrides(tmp_path / "run", **{"train.steps": 2000, "observe.prometheus.port": port}),
    )
    thread, stop, box = _run_in_thread(cfg)
    try:
        _wait_for_steps(port, 1)
        config = write_config(tmp_path / "prometheus.yml", [f"127.0.0.1:{port}"])
        with running_prometheus(config, tmp_path) as prom:
            result = wait_for(prom, 'rl_reward_mean{job="rlpost"}', lambda r: len(r) == 1)
            value = value_of(result)
            assert value is not None and 0.0 <= value <= 1.0
            steps = value_of(wait_for(prom, "rl_step_total", lambda r: len(r) == 1))
            assert steps is not None and steps >= 1
    finally:
        stop.set()
        thread.join(timeout=120)
    assert "error" not in box, box.get("error")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_nan_rewards_are_dropped_and_the_guard_is_counted(tmp_path, caplog):
    over = small_overrides(
        tmp_path,
        **{
            "reward.terms": "[{name: 'tests.integration.rewards_for_tests:nan_reward'}]",
            # every sample is scored by the term (truncated ones too), so every step has NaNs
            "rollout.truncated_reward": "null",
        },
    )
    with caplog.at_level(logging.WARNING):
        result = train(load_config(None, over))
    rows = [r for r in _rows(result.run_dir) if "loss" in r]
    assert all(math.isfinite(r["loss"]) and r["invalid_rewards"] > 0 for r in rows)
    assert max(r.get("guard_nonfinite_reward", 0) for r in _rows(result.run_dir)) >= 1
    assert "nonfinite_reward" in caplog.text


def test_learning_rate_1000x_too_high_survives_with_guards(tmp_path, caplog):
    over = small_overrides(
        tmp_path,
        **{
            "train.optim.lr": 1.0,
            "train.steps": 10,
            "observe.guards.cooldown": 0,
            "checkpoint.every": 2,
            "observe.guards.kl_ceiling": 1.0,
            "train.mini_batch_size": 4,
            "train.micro_batch_size": 4,
            "rollout.truncated_reward": "null",
            "reward.terms": "[{name: 'tests.integration.rewards_for_tests:length_reward'}]",
        },
    )
    with caplog.at_level(logging.WARNING):
        result = train(load_config(None, over))
    rows = _rows(result.run_dir)
    acted = {k for r in rows for k in r if k.startswith("guard_")}
    assert acted, "no guard acted on a 1000x learning rate"
    assert "guard" in caplog.text
    assert any(r.get("beta", 0) > 0.04 or r.get("lr", 1.0) < 0.5 for r in rows), (
        "no remedy was applied"
    )
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r and not r.get("skipped"))


def test_reference_kl_forced_up_raises_beta(tmp_path, monkeypatch, caplog):
    real_copy = build.frozen_copy

    def far_reference(model):
        ref = real_copy(model)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        return ref

    monkeypatch.setattr(build, "frozen_copy", far_reference)
    over = small_overrides(
        tmp_path,
        **{"train.steps": 4, "observe.guards.kl_ceiling": 0.5, "observe.guards.cooldown": 0},
    )
    with caplog.at_level(logging.WARNING):
        result = train(load_config(None, over))
    rows = [r for r in _rows(result.run_dir) if "kl" in r]
    assert rows[0]["kl"] > 0.5
    betas = [r["beta"] for r in rows]
    assert betas[-1] > betas[0]
    assert any(r.get("guard_kl_explosion", 0) >= 1 for r in _rows(result.run_dir))
    assert "raise_beta" in caplog.text
