"""deploy/prometheus/alerts.yml is valid and its promtool unit tests pass (needs promtool)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.prom_util import NO_PROMETHEUS, PROMTOOL

pytestmark = [
    pytest.mark.promtool,
    pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMETHEUS),
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERTS = (
    "RLRewardCollapse",
    "RLKLExplosion",
    "RLLengthCollapse",
    "RLLowTrainMFU",
    "RLHighSampleDrop",
    "RLStalenessGrowing",
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60, check=False
    )


def test_rules_are_valid():
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


def test_example_config_is_valid():
    done = promtool("check", "config", "prometheus.example.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_fires_and_stays_silent_in_the_unit_tests():
    done = promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    tests = (DEPLOY / "alerts_test.yml").read_text()
    for alert in ALERTS:
        assert f"alertname: {alert}" in tests
        assert f"docs/operations.md#{alert.lower()}" in (DEPLOY / "alerts.yml").read_text()


def test_falling_gauges_use_deriv_not_rate():
    rules = (DEPLOY / "alerts.yml").read_text()
    assert "deriv(rl_reward_mean[10m]) < -0.1" in rules
    assert "deriv(rl_response_length_mean[10m]) < -0.3" in rules
    assert "rate(rl_" not in rules
