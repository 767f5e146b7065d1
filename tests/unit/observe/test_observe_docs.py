"""docs/operations.md and deploy/prometheus/alerts.yml stay in step with the metric table and guards."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rlpost.observe.guards import GuardConfig
from rlpost.observe.metrics import ALL_NAMES

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "operations.md").read_text()
RULES = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"][0][
    "rules"
]


def test_every_metric_is_documented_in_the_table():
    for name in ALL_NAMES:
        assert f"| `{name}" in DOC, name


def test_alerts_use_only_table_metrics_and_have_units_and_runbooks():
    assert [rule["alert"] for rule in RULES] == [
        "RLRewardCollapse",
        "RLKLExplosion",
        "RLLengthCollapse",
        "RLLowTrainMFU",
        "RLHighSampleDrop",
        "RLStalenessGrowing",
    ]
    for rule in RULES:
        for metric in re.findall(r"rl_[a-z_]+", rule["expr"]):
            assert metric in ALL_NAMES, metric
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}
        anchor = rule["alert"].lower()
        assert notes["runbook_url"] == f"docs/operations.md#{anchor}"
        assert f"\n### {rule['alert']}\n" in DOC
        assert f"`{rule['expr']}`" in DOC
        assert any(
            unit in notes["description"]
            for unit in ("per second", "nats/token", "fraction", "versions")
        )


def test_every_guard_setting_is_documented():
    for field in GuardConfig.model_fields:
        assert f"| `{field}` |" in DOC, field
