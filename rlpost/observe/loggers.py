"""Metric loggers besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

Each an extra of its name, chosen with ``observe.loggers``, writing locally by default
(where, and the environment variables: docs/operations.md). Loggers get finite values only.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

LOGGERS = ("tensorboard", "wandb", "mlflow")


class MetricLogger(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def open_loggers(names: list[str] | tuple[str, ...], run_dir: Path | None) -> list[MetricLogger]:
    """The loggers named (each once, in order); they need a run directory."""
    if names and run_dir is None:
        raise ValueError("metric loggers need a run directory; pass run_dir")
    classes = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MLflowLogger}
    for name in names:
        if name not in classes:
            raise ValueError(f"unknown logger {name!r}; valid: {', '.join(LOGGERS)}")
    return [classes[name](run_dir) for name in dict.fromkeys(names)]


def _run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _finite(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if math.isfinite(v)}


class TensorBoardLogger:
    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "observe.tensorboard=true needs the [tensorboard] extra: pip install 'rlpost[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rlpost"),
            name=run_dir.name,
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=_run_config(run_dir),
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        # W&B's step must not go backwards; a resumed run's replayed steps go in as logged.
        self.run.log({**_finite(values), "step": step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits until the run file is written out (offline mode included)


class MLflowLogger:
    def __init__(self, run_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store behind an opt-in; it needs no database or server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlpost")
        experiment = self.client.get_experiment_by_name(name)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        self._log_params(_run_config(run_dir))

    def _log_params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = _flatten(config)
        params = [Param(k, str(v)[:500]) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _finite(values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
