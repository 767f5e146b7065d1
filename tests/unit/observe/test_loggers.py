"""Each metric logger, read back from what it wrote on disk (skipped when its extra is missing)."""

from __future__ import annotations

import json
import struct

import pytest

from rlpost.observe.recorder import Recorder

ROWS = [(1, {"loss": 0.5, "reward_mean": 0.25}), (2, {"loss": 0.125, "reward_mean": None})]


def _record(run_dir, logger):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("run: {name: r}\ntrain: {optim: {lr: 0.001}}\n")
    with Recorder(run_dir, loggers=[logger]) as rec:
        for step, values in ROWS:
            rec.record(step, values)


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _record(tmp_path / "r", "tensorboard")
    events = EventAccumulator(str(tmp_path / "r" / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.125)]
    assert [e.step for e in events.Scalars("reward_mean")] == [1]  # not measured: left out


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _record(tmp_path / "r", "mlflow")
    client = MlflowClient(tracking_uri=(tmp_path / "r" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rlpost").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.125)]
    assert run.data.params["train.optim.lr"] == "0.001" and run.info.run_name == "r"
    assert run.info.status == "FINISHED"


def _wandb_records(path):
    """Records of a W&B run file: a LevelDB-style log of 32 KiB blocks after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, pos, buf, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def test_wandb_offline_with_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _record(tmp_path / "r", "wandb")
    (path,) = (tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(path)
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["step"], h["loss"]) for h in history] == [(1, 0.5), (2, 0.125)]
    assert "reward_mean" not in history[1]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"] == {"optim": {"lr": 0.001}}
