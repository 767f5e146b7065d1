"""Model FLOPs utilisation: achieved FLOP/s over the hardware's peak.

FLOPs per trained token follow PaLM (Chowdhery et al. 2022, appendix B): ``6N + 12·L·H·S``
for N parameters, L layers, width H, length S, no causal-mask saving. Generation with a KV
cache costs ``2N + 2·L·H·S``. A CPU's peak is measured (:func:`measure_cpu_peak_flops`).
"""

from __future__ import annotations

import functools
import os
import time


def flops_per_token(
    n_params: int, n_layers: int, hidden: int, seq_len: int, *, training: bool
) -> float:
    """FLOPs for one token: ``6N + 12·L·H·S`` training, ``2N + 2·L·H·S`` generation;
    ``n_params`` without embeddings."""
    sizes = {"n_params": n_params, "n_layers": n_layers, "hidden": hidden, "seq_len": seq_len}
    for name, value in sizes.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    attention = n_layers * hidden * seq_len
    if training:
        return 6.0 * n_params + 12.0 * attention
    return 2.0 * n_params + 2.0 * attention


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``flops / seconds / peak_flops`` (a fraction, 0-1)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return flops / seconds / peak_flops


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 3, dtype=None) -> float:
    """Best FLOP/s of a ``size x size`` matmul over ``repeats`` runs, at torch's threads."""
    if size < 1 or repeats < 1:
        raise ValueError(f"size and repeats must be >= 1, got size={size} repeats={repeats}")
    import torch

    a, b = (torch.randn(size, size).to(dtype or torch.float32) for _ in range(2))
    torch.mm(a, b)  # warm up: first call pays for thread-pool start and allocation
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2.0 * size**3 / max(elapsed, 1e-9))
    return best


@functools.cache
def default_cpu_peak_flops() -> float:
    """:func:`measure_cpu_peak_flops` with its defaults, measured once per process."""
    return measure_cpu_peak_flops()


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 instructions that compute in bfloat16 natively."""


def _cpuinfo_value(keys: tuple[str, ...], cpuinfo: str | None) -> str:
    """The value of the first Linux ``/proc/cpuinfo`` line that starts with one of ``keys``
    ("" where there is none or the file cannot be read)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (empty where they cannot be read)."""
    return set(_cpuinfo_value(("flags", "Features"), cpuinfo).split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``; "" where it cannot be read)."""
    return _cpuinfo_value(("vendor_id",), cpuinfo)


def cpu_bf16_native(cpuinfo: str | None = None) -> bool:
    """True when the CPU has bfloat16 instructions (AVX-512 BF16 or AMX-BF16)."""
    return bool(cpu_flags(cpuinfo) & set(CPU_BF16_FLAGS))


def pick_threads(requested: int, *, cores: int | None = None, load: float | None = None) -> int:
    """torch threads for ``run.threads``: ``requested`` when > 0, else the cores others leave
    free (at least 1); a thread on a busy core stalls every parallel region."""
    if requested < 0:
        raise ValueError(f"threads must be >= 0, got {requested}")
    if requested:
        return requested
    if cores is None and load is None:
        # once per process, so a run and its resume round floats alike
        if not _AUTO_THREADS:
            cores, load = _usable_cores(), _load()
            _AUTO_THREADS.append(pick_threads(0, cores=cores, load=load))
            _AUTO_WHY[:] = [cores, load]  # for the one line that says why
        return _AUTO_THREADS[0]
    cores = _usable_cores() if cores is None else cores
    load = _load() if load is None else load
    return max(1, min(cores, cores - round(load)))


_AUTO_THREADS: list[int] = []
_AUTO_WHY: list[float] = []  # the usable cores and the busy CPUs behind _AUTO_THREADS


def _usable_cores() -> int:
    allowed = _allowed_cpus()
    return len(allowed) if allowed is not None else os.cpu_count() or 1


def busy_cpus(before: list[int], after: list[int], cpus: int) -> float:
    """CPUs other work kept busy between two samples of ``/proc/stat``'s ``cpu`` line
    (user, nice, system, idle, iowait, irq, softirq, steal jiffies, summed over all CPUs)."""
    spent = [b - a for a, b in zip(before[:8], after[:8], strict=False)]
    total = sum(spent)
    if total <= 0:
        return 0.0
    idle = spent[3] + (spent[4] if len(spent) > 4 else 0)
    return max(0.0, cpus * (1.0 - idle / total))


def _cpu_times(cpus: set[int] | None = None) -> list[int] | None:
    """The jiffies of ``/proc/stat`` summed over ``cpus`` (its ``cpuN`` lines; None: every
    CPU, its ``cpu`` line)."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    if cpus is None:
        rows = [x for x in lines if x[0] == "cpu"]
    else:
        rows = [x for x in lines if x[0][3:].isdigit() and int(x[0][3:]) in cpus]
    if not rows:
        return None
    return [sum(int(x[k]) for x in rows) for k in range(1, 9)]


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return None


def _load(window_s: float = 0.3) -> float:
    """CPUs busy now, from /proc/stat over ``window_s`` (the 1-minute load average lags)."""
    allowed = _allowed_cpus()  # only the CPUs this process may run on count
    before = _cpu_times(allowed)
    if before is None:
        try:
            return os.getloadavg()[0]
        except OSError:  # no load average on this platform
            return 0.0
    time.sleep(window_s)
    after = _cpu_times(allowed)
    cpus = len(allowed) if allowed is not None else os.cpu_count() or 1
    return busy_cpus(before, after, cpus) if after else 0.0
