"""One recorder writes each step's metrics to every sink that is on.

Sinks: ``RUN_DIR/metrics.jsonl`` (flushed each step; non-finite values as ``null``), a
Prometheus endpoint on its own ``CollectorRegistry``, and :mod:`rlpost.observe.loggers`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rlpost.observe.loggers import open_loggers
from rlpost.observe.metrics import (
    BY_KEY,
    GUARD_KEY_PREFIX,
    GUARD_METRIC,
    METRICS,
    SOURCE_KEY_PREFIX,
    SOURCE_METRICS,
    SYNC_BUCKETS,
    MetricSpec,
)

METRICS_FILE = "metrics.jsonl"


def _make_metric(spec: MetricSpec, registry: CollectorRegistry) -> Any:
    if spec.kind == "histogram":
        return Histogram(spec.name, spec.help, buckets=SYNC_BUCKETS, registry=registry)
    return {"gauge": Gauge, "counter": Counter}[spec.kind](spec.name, spec.help, registry=registry)


def _to_float(key: str, value: Any) -> float:
    if value is None:  # "not measured this step": null in JSONL, gauge left as it was
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {key!r} has non-numeric value {value!r}") from None


def _json_value(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Recorder:
    """Writes step metrics to every sink, thread-safe; ``run_dir=None`` turns the file sinks
    off, ``prometheus_port=0`` binds an ephemeral :attr:`port`."""

    def __init__(
        self,
        run_dir: Path | None,
        *,
        prometheus_port: int | None = None,
        prometheus_host: str = "127.0.0.1",
        tensorboard: bool = False,
        start_step: int | None = None,
        loggers: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.registry = CollectorRegistry()
        self._metrics = {spec.key: _make_metric(spec, self.registry) for spec in METRICS}
        self._guards = Counter(
            GUARD_METRIC.name, GUARD_METRIC.help, ["guard"], registry=self.registry
        )
        self._sources = {
            spec.key: Gauge(spec.name, spec.help, ["source"], registry=self.registry)
            for spec in SOURCE_METRICS
        }
        self._guard_counts: dict[str, int] = {}
        self._guards_changed: set[str] = set()
        # rows at ``start_step`` (before the first update) do not advance rl_step_total
        self._last_step: int | None = start_step
        self._lock = threading.Lock()
        self._file = None
        self._server = None
        self._thread = None
        names = [*(["tensorboard"] if tensorboard else []), *loggers]
        self._loggers = open_loggers(names, self.run_dir)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = (self.run_dir / METRICS_FILE).open("a", encoding="utf-8")
        if prometheus_port is not None:
            self._start_server(prometheus_host, prometheus_port)

    def _start_server(self, host: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            self.close()
            raise OSError(
                f"cannot serve Prometheus metrics on {host}:{port} ({exc.strerror}); "
                "set observe.prometheus.port to a free port, or 0 for any"
            ) from None

    @property
    def port(self) -> int | None:
        """The bound Prometheus port (None when the endpoint is off)."""
        return None if self._server is None else self._server.server_port

    def record(self, step: int, values: dict[str, Any]) -> None:
        """Record one step's metrics (``None``: not measured); keys outside
        ``metrics.METRICS`` go to JSONL and TensorBoard only."""
        floats = {key: _to_float(key, value) for key, value in values.items()}
        missing = {key for key, value in values.items() if value is None}
        if "step" in floats or "time" in floats:
            raise ValueError("metric keys 'step' and 'time' are reserved; pass the step argument")
        with self._lock:
            if step != self._last_step:
                self._metrics["step"].inc()
                self._last_step = step
            for key, value in floats.items():
                if key.startswith(SOURCE_KEY_PREFIX):
                    self._set_source(key, value)
                    continue
                spec = BY_KEY.get(key)
                if spec is None or key in missing:
                    continue
                if spec.kind == "histogram":
                    if math.isfinite(value):
                        self._metrics[key].observe(value)
                elif spec.kind == "counter":  # the step's amount is added to the running total
                    if math.isfinite(value) and value > 0:
                        self._metrics[key].inc(value)
                else:
                    self._metrics[key].set(value)
            for guard in sorted(self._guards_changed):
                floats[GUARD_KEY_PREFIX + guard] = float(self._guard_counts[guard])
            self._guards_changed.clear()
            self._write_row(step, floats, missing)

    def _write_row(self, step: int, floats: dict[str, float], missing: set[str]) -> None:
        if self._file is not None:
            row = {"step": step, "time": time.time()}
            row.update({key: _json_value(value) for key, value in floats.items()})
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        if self._loggers:
            measured = {key: value for key, value in floats.items() if key not in missing}
            for logger in self._loggers:
                logger.log(step, measured)

    def _set_source(self, key: str, value: float) -> None:
        """``source/<name>/<field>``: the per-source gauge of ``field`` at ``source=<name>``."""
        name, _, field = key[len(SOURCE_KEY_PREFIX) :].rpartition("/")
        gauge = self._sources.get(field)
        if gauge is not None and name and math.isfinite(value):
            gauge.labels(source=name).set(value)

    def count_guard(self, guard: str) -> None:
        """Count one guard action; the running count goes into the next JSONL row."""
        with self._lock:
            self._guards.labels(guard=guard).inc()
            self._guard_counts[guard] = self._guard_counts.get(guard, 0) + 1
            self._guards_changed.add(guard)

    def close(self) -> None:
        """Stop the endpoint and close the files; safe to call twice."""
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._thread.join(timeout=5)
                self._server = self._thread = None
            if self._file is not None:
                self._file.close()
                self._file = None
            for logger in self._loggers:
                logger.close()
            self._loggers = []

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """``RUN_DIR/metrics.jsonl`` as one dict per step (later keys winning), a torn last line
    skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    merged: dict[int, dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise ValueError(f"{path}:{number} is not valid JSON") from None
        merged.setdefault(int(row["step"]), {}).update(row)
    return [merged[step] for step in sorted(merged)]
