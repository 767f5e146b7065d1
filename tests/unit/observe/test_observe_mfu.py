"""FLOP counts and MFU (PaLM appendix B), hand-computed (CPU)."""

from __future__ import annotations

import pytest

import rlpost.observe.mfu as mfu_module
from rlpost.observe.mfu import default_cpu_peak_flops, flops_per_token, measure_cpu_peak_flops, mfu


def test_training_flops_match_palm_count():
    # N = 1e6 params, L = 2, H = 64, S = 128: 6e6 + 12*2*64*128 = 6e6 + 196608
    assert flops_per_token(1_000_000, 2, 64, 128, training=True) == 6_196_608.0


def test_generation_flops_are_forward_with_causal_average():
    # 2e6 + 2*2*64*128 = 2e6 + 32768
    assert flops_per_token(1_000_000, 2, 64, 128, training=False) == 2_032_768.0


def test_training_is_three_times_forward_without_attention():
    assert flops_per_token(10_000, 4, 32, 0, training=True) == 3 * flops_per_token(
        10_000, 4, 32, 0, training=False
    )


def test_mfu_is_achieved_over_peak():
    assert mfu(flops=4e12, seconds=2.0, peak_flops=1e13) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seconds": 0.0, "peak_flops": 1.0}, "seconds"),
        ({"seconds": 1.0, "peak_flops": 0.0}, "peak"),
    ],
)
def test_mfu_refuses_non_positive_denominators(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mfu(1.0, **kwargs)


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        flops_per_token(1, 1, 1, -1, training=True)


def test_measured_peak_is_plausible():
    peak = measure_cpu_peak_flops(size=256, repeats=2)
    # any CPU that runs torch does > 100 MFLOP/s and < 100 PFLOP/s on float32 matmul
    assert 1e8 < peak < 1e17
    with pytest.raises(ValueError, match="size and repeats"):
        measure_cpu_peak_flops(size=0)


def test_default_peak_is_measured_once(monkeypatch):
    calls = []
    monkeypatch.setattr(mfu_module, "measure_cpu_peak_flops", lambda: calls.append(1) or 5e10)
    default_cpu_peak_flops.cache_clear()
    try:
        assert default_cpu_peak_flops() == default_cpu_peak_flops() == 5e10
        assert calls == [1]
    finally:
        default_cpu_peak_flops.cache_clear()


def test_bf16_peak_is_measured_in_bf16(monkeypatch):
    import torch

    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append((a.dtype, b.dtype)) or mm(a, b))
    peak = measure_cpu_peak_flops(size=64, repeats=2, dtype=torch.bfloat16)
    assert peak > 0  # no lower bound: a loaded machine may take any time
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 3  # the warm-up and each repeat


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni", True),
        ("fpu sse avx2 amx_bf16 amx_tile", True),
        ("fpu sse avx2 avx512f avx512_vnni", False),
    ],
)
def test_bf16_support_is_read_from_the_cpu_flags(flags, native):
    cpuinfo = f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n"
    assert mfu_module.cpu_bf16_native(cpuinfo) is native
    assert "avx2" in mfu_module.cpu_flags(cpuinfo)


def test_unreadable_cpuinfo_means_no_flags():
    assert mfu_module.cpu_flags("") == set()
    assert mfu_module.cpu_bf16_native("") is False


@pytest.mark.parametrize(
    ("requested", "cores", "load", "threads"),
    [
        (3, 2, 5.0, 3),  # an explicit count is kept whatever the load
        (0, 2, 0.1, 2),  # quiet: every core
        (0, 2, 1.2, 1),  # one core busy elsewhere: the free one
        (0, 2, 9.0, 1),  # overloaded: never below one
        (0, 8, 2.6, 5),
    ],
)
def test_threads_follow_the_free_cores(requested, cores, load, threads):
    assert mfu_module.pick_threads(requested, cores=cores, load=load) == threads


def test_negative_threads_are_refused():
    with pytest.raises(ValueError, match="threads must be >= 0"):
        mfu_module.pick_threads(-1)


def test_the_cli_makes_openmp_wait_passively(tmp_path):
    import subprocess
    import sys

    code = "import os, rlpost.cli; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a choice the user made stands
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "ACTIVE"


def test_automatic_threads_are_decided_once_per_process(monkeypatch):
    monkeypatch.setattr(mfu_module, "_AUTO_THREADS", [])
    loads = iter([0.0, 1.5])
    monkeypatch.setattr(mfu_module, "_load", lambda: next(loads))
    monkeypatch.setattr(mfu_module, "_usable_cores", lambda: 2)
    first = mfu_module.pick_threads(0)
    assert first == 2
    assert mfu_module.pick_threads(0) == first  # the load rose; the choice stands


def test_busy_cpus_come_from_the_jiffies_spent_between_two_samples():
    # user nice system idle iowait irq softirq steal, summed over 4 CPUs
    before = [100, 0, 50, 1000, 10, 0, 0, 0]
    one_busy = [200, 0, 100, 1240, 20, 0, 0, 0]  # 150 busy of 400 spent: 1.5 of 4 CPUs
    assert mfu_module.busy_cpus(before, one_busy, 4) == pytest.approx(1.5)
    idle = [100, 0, 50, 1400, 10, 0, 0, 0]
    assert mfu_module.busy_cpus(before, idle, 4) == 0.0
    assert mfu_module.busy_cpus(before, before, 4) == 0.0  # no time passed: nothing known


def test_the_live_sample_reads_this_machine():
    busy = mfu_module._load(window_s=0.05)
    assert 0.0 <= busy <= (__import__("os").cpu_count() or 1) + 1e-6


def test_cpu_times_sum_only_the_cpus_this_process_may_use():
    every = mfu_module._cpu_times()
    cpus = sorted(__import__("os").sched_getaffinity(0))
    one = mfu_module._cpu_times({cpus[0]})
    mine = mfu_module._cpu_times(set(cpus))
    assert every is not None and one is not None and mine is not None
    assert all(a <= b for a, b in zip(one, mine, strict=True))  # a subset spends no more
    assert mfu_module._cpu_times({10**6}) is None  # no such CPU: nothing to read
