"""Observability: the ``rl_*`` metric table, its writers, MFU, guards and the run report.

Imported by every layer and importing none of them (only ``rlpost.registry`` and
``rlpost.types`` are allowed). The report (matplotlib) is imported from
``rlpost.observe.report`` on demand, so recording metrics stays light.
``rlpost.observe.mfu`` is the module; the function is ``rlpost.observe.mfu.mfu``.
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
