"""Recorder and metric table: JSONL, Prometheus endpoint, TensorBoard wiring (CPU, no network)."""

from __future__ import annotations

import json
import math
import socket
import sys
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlpost.observe import metrics as table
from rlpost.observe.recorder import METRICS_FILE, Recorder, read_metrics

ISSUE_NAMES = {
    "rl_step_total",
    "rl_reward_mean",
    "rl_reward_std",
    "rl_kl_divergence",
    "rl_response_length_mean",
    "rl_ratio_clip_frac",
    "rl_rollout_throughput_tps",
    "rl_train_mfu",
    "rl_weight_sync_duration_seconds",
    "rl_weight_sync_bytes_total",
    "rl_rollout_worker_utilization",
    "rl_train_worker_utilization",
    "rl_sample_mean_lag",
    "rl_sample_drop_ratio",
}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_table_has_exactly_the_issue_names_with_units_and_unique_keys():
    assert {spec.name for spec in table.METRICS} == ISSUE_NAMES
    assert len(table.METRICS) == 14
    assert table.GUARD_METRIC.name == "rl_guard_actions_total"
    keys = [spec.key for spec in table.METRICS]
    assert len(set(keys)) == len(keys)
    for spec in (*table.METRICS, table.GUARD_METRIC):
        assert spec.kind in ("gauge", "counter", "histogram")
        assert "[" in spec.help and spec.help.endswith("].")
        assert spec.name.endswith("_total") == (spec.kind == "counter")


def test_record_writes_one_json_row_per_step_with_null_for_non_finite(tmp_path):
    with Recorder(tmp_path, prometheus_port=None) as rec:
        rec.record(1, {"reward_mean": 0.25, "kl": math.nan, "loss": math.inf, "lr": 1e-5})
        rec.record(2, {"reward_mean": 0.5, "eval_accuracy": 0.1})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2

    def refuse(token):
        raise AssertionError(f"invalid JSON constant {token}")

    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert rows[0]["step"] == 1 and rows[0]["reward_mean"] == 0.25
    assert rows[0]["kl"] is None and rows[0]["loss"] is None and rows[0]["lr"] == 1e-5
    assert rows[1]["time"] >= rows[0]["time"] > 1.6e9
    assert read_metrics(tmp_path) == rows


def test_endpoint_exports_table_keys_only_and_counts_steps(tmp_path):
    with Recorder(tmp_path, prometheus_port=0) as rec:
        assert rec.port and rec.port > 0
        rec.record(1, {"reward_mean": 0.2, "sync_seconds": 0.3, "sync_bytes": 1000, "loss": 7.0})
        rec.record(1, {"eval_accuracy": 0.4})  # same step again: not a new step
        rec.record(2, {"reward_mean": 0.6, "mfu": 0.12, "sync_seconds": 0.1, "sync_bytes": 500})
        rec.count_guard("kl_explosion")
        rec.count_guard("kl_explosion")
        rec.count_guard("reward_collapse")
        got = scrape(rec.port)
    assert got[("rl_step_total", ())] == 2
    assert got[("rl_reward_mean", ())] == pytest.approx(0.6)
    assert got[("rl_train_mfu", ())] == pytest.approx(0.12)
    assert got[("rl_weight_sync_duration_seconds_count", ())] == 2
    assert got[("rl_weight_sync_duration_seconds_sum", ())] == pytest.approx(0.4)
    assert got[("rl_weight_sync_bytes_total", ())] == 1500  # a counter adds each step's bytes
    assert got[("rl_guard_actions_total", (("guard", "kl_explosion"),))] == 2
    assert got[("rl_guard_actions_total", (("guard", "reward_collapse"),))] == 1
    names = {name for name, _ in got}
    assert {table.exposed_sample_name(spec) for spec in table.METRICS} <= names
    assert not any("loss" in name or "eval" in name for name in names)


def test_none_means_not_measured_and_leaves_the_gauge_alone(tmp_path):
    with Recorder(tmp_path, prometheus_port=0) as rec:
        rec.record(1, {"kl": 0.5, "eval_accuracy": 0.3})
        rec.record(2, {"kl": None, "eval_accuracy": None})
        assert scrape(rec.port)[("rl_kl_divergence", ())] == 0.5
    rows = read_metrics(tmp_path)
    assert rows[1]["kl"] is None and rows[1]["eval_accuracy"] is None


def test_guard_counts_go_into_the_next_row_only(tmp_path):
    with Recorder(tmp_path) as rec:
        rec.count_guard("clip_frac")
        rec.record(1, {"clip_frac": 0.7})
        rec.record(2, {"clip_frac": 0.1})
        rec.count_guard("clip_frac")
        rec.record(3, {"clip_frac": 0.9})
    rows = read_metrics(tmp_path)
    assert rows[0]["guard_clip_frac"] == 1
    assert "guard_clip_frac" not in rows[1]
    assert rows[2]["guard_clip_frac"] == 2


def test_two_recorders_in_one_process_do_not_clash(tmp_path):
    with Recorder(tmp_path / "a", prometheus_port=0) as a, Recorder(None, prometheus_port=0) as b:
        a.record(1, {"reward_mean": 1.0})
        b.record(1, {"reward_mean": 2.0})
        assert scrape(a.port)[("rl_reward_mean", ())] == 1.0
        assert scrape(b.port)[("rl_reward_mean", ())] == 2.0
    assert not (tmp_path / "b").exists()


def test_busy_port_is_one_line_error_naming_the_setting():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(OSError, match=r"observe\.prometheus\.port") as err:
            Recorder(None, prometheus_port=port)
    assert "\n" not in str(err.value)


def test_close_stops_endpoint_and_is_idempotent(tmp_path):
    rec = Recorder(tmp_path, prometheus_port=0)
    port = rec.port
    rec.close()
    rec.close()
    assert rec.port is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_bad_values_and_reserved_keys_are_refused(tmp_path):
    with Recorder(tmp_path) as rec:
        with pytest.raises(ValueError, match="'kl' has non-numeric value 'high'"):
            rec.record(1, {"kl": "high"})
        with pytest.raises(ValueError, match="reserved"):
            rec.record(1, {"step": 3})
    assert read_metrics(tmp_path) == []


def test_read_metrics_merges_same_step_and_skips_torn_last_line(tmp_path):
    assert read_metrics(tmp_path) == []
    path = tmp_path / METRICS_FILE
    path.write_text(
        '{"step": 2, "time": 2.0, "loss": 1.0}\n'
        '{"step": 1, "time": 1.0, "loss": 3.0}\n'
        '{"step": 2, "time": 2.5, "eval_accuracy": 0.5}\n'
        '{"step": 3, "ti'
    )
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1] == {"step": 2, "time": 2.5, "loss": 1.0, "eval_accuracy": 0.5}
    path.write_text('{"step": 1, "ti\n{"step": 2, "time": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1 is not valid JSON"):
        read_metrics(tmp_path)


def test_tensorboard_without_the_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"\[tensorboard\]"):
        Recorder(tmp_path, tensorboard=True)


def test_tensorboard_gets_every_key(tmp_path, monkeypatch):
    scalars, closed = [], []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            closed.append(self.log_dir)

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with Recorder(tmp_path, tensorboard=True) as rec:
        rec.record(4, {"reward_mean": 0.5, "loss": 2.0, "eval_accuracy": None})
    assert scalars == [("reward_mean", 0.5, 4), ("loss", 2.0, 4)]
    assert closed == [str(tmp_path / "tb")]
