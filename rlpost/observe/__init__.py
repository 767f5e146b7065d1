"""Observability: the ``rl_*`` metric table, its writers, MFU, guards and the run report.

Imports only ``rlpost.registry`` and ``rlpost.types``; the report (matplotlib) loads on demand.
"""

from rlpost.observe.guards import Action, GuardConfig, Guards
from rlpost.observe.metrics import ALL_NAMES, BY_KEY, GUARD_METRIC, METRICS, MetricSpec
from rlpost.observe.mfu import default_cpu_peak_flops, flops_per_token, measure_cpu_peak_flops
from rlpost.observe.recorder import Recorder, read_metrics

__all__ = [
    "ALL_NAMES",
    "BY_KEY",
    "GUARD_METRIC",
    "METRICS",
    "Action",
    "GuardConfig",
    "Guards",
    "MetricSpec",
    "Recorder",
    "default_cpu_peak_flops",
    "flops_per_token",
    "measure_cpu_peak_flops",
    "read_metrics",
]
