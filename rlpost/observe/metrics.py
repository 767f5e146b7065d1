"""The one table of ``rl_*`` metric names, and where each is written.

Each short key maps to its Prometheus name, type and help; keys outside the table are not
exported, since the exported set is the contract of ``deploy/prometheus``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric; ``help`` states the unit in brackets."""

    name: str
    kind: MetricKind
    help: str
    key: str


METRICS: tuple[MetricSpec, ...] = tuple(
    MetricSpec(name, kind, text, key)
    for name, kind, key, text in (
        ("rl_step_total", "counter", "step", "Training steps recorded [steps]."),
        ("rl_reward_mean", "gauge", "reward_mean",
         "Mean reward of the step's samples [reward units]."),
        ("rl_reward_std", "gauge", "reward_std",
         "Standard deviation of the step's rewards [reward units]."),
        ("rl_kl_divergence", "gauge", "kl",
         "Mean per-token KL(policy || reference) over response tokens [nats/token]."),
        ("rl_response_length_mean", "gauge", "response_length_mean",
         "Mean response length [tokens]."),
        ("rl_ratio_clip_frac", "gauge", "clip_frac",
         "Fraction of response tokens whose importance ratio was clipped [0-1]."),
        ("rl_rollout_throughput_tps", "gauge", "rollout_tps",
         "Rollout generation throughput [generated tokens/second]."),
        ("rl_train_mfu", "gauge", "mfu",
         "Trainer model FLOPs utilisation: achieved / peak FLOP/s [0-1]."),
        ("rl_weight_sync_duration_seconds", "histogram", "sync_seconds",
         "Time to push new weights to the rollout engines [seconds]."),
        ("rl_weight_sync_bytes_total", "counter", "sync_bytes",
         "Bytes sent to the rollout engines by weight syncs [bytes]."),
        ("rl_rollout_worker_utilization", "gauge", "rollout_utilization",
         "Fraction of wall time rollout workers spent generating [0-1]."),
        ("rl_train_worker_utilization", "gauge", "train_utilization",
         "Fraction of wall time train workers spent computing updates [0-1]."),
        ("rl_sample_mean_lag", "gauge", "sample_lag",
         "Mean policy-version lag of trained samples (trainer version - sample version) "
         "[versions]."),
        ("rl_sample_drop_ratio", "gauge", "sample_drop_ratio",
         "Fraction of the step's generated samples not trained: invalid rewards and "
         "samples dropped as too stale [0-1]."),
    )
)  # fmt: skip
"""The exported step metrics, in display order (``docs/operations.md`` mirrors it)."""

GUARD_METRIC = MetricSpec(
    "rl_guard_actions_total",
    "counter",
    "Actions taken by training guards, labelled by guard [actions].",
    "guard",
)
"""Counter labelled ``guard=<name>``; advanced by ``Recorder.count_guard``."""

GUARD_KEY_PREFIX = "guard_"
"""In ``metrics.jsonl`` a guard's running action count is written as ``guard_<name>``."""

SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Histogram buckets for weight-sync seconds: in-process copies (ms) up to
multi-GB transfers over the network (minutes)."""

BY_KEY: dict[str, MetricSpec] = {spec.key: spec for spec in METRICS}
"""Record key -> spec, for the keys exported to Prometheus."""

SOURCE_METRICS: tuple[MetricSpec, ...] = tuple(
    MetricSpec(f"rl_source_{key}", "gauge", f"{text}, labelled by data source [{unit}].", key)
    for key, text, unit in (
        ("reward_mean", "Mean final reward of one source's samples", "reward units"),
        ("accuracy", "Fraction of one source's samples scoring above 0.5", "0-1"),
        ("response_length_mean", "Mean response length of one source's samples", "tokens"),
        ("truncated_frac", "Fraction of one source's samples cut at max_tokens", "0-1"),
        ("zero_spread_frac", "Fraction of one source's groups with equal scores", "0-1"),
    )
)
"""Gauges labelled ``source=<name>``, set from the ``source/<name>/<key>`` record keys of a
mixture run (``pipeline/source_metrics.py``)."""

SOURCE_KEY_PREFIX = "source/"

ALL_NAMES: tuple[str, ...] = (*(spec.name for spec in METRICS), GUARD_METRIC.name)
"""Every exported metric name of every run (the 14 step metrics and the guard counter;
a mixture run adds :data:`SOURCE_METRICS`)."""


def exposed_sample_name(spec: MetricSpec) -> str:
    """Name of the sample line that carries ``spec`` (a histogram's ``_count``)."""
    return spec.name + "_count" if spec.kind == "histogram" else spec.name


class DuplicateMetric(ValueError):
    """Two sources of one step's metrics wrote the same key."""


def merge_metrics(*parts: dict[str, float]) -> dict[str, float]:
    """One step's metrics from the dicts of the stages that own them; a key written by two
    parts is an error (a later part would otherwise overwrite it silently)."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key in out:
                raise DuplicateMetric(f"metric {key!r} is written by two sources of one step")
            out[key] = value
    return out
