"""The real-shape bench's report: the fitted slope, the table's ratios, runs that did not fit."""

import pytest

from bench.real_shape_report import fit, load_runs, modes_table, reference_slopes, report


def _run(side, length, peak, step):
    return {"side": side, "dtype": "fp32", "length": length, "peak_rss_mib": peak, "step": step}


def test_the_fit_recovers_a_line_and_needs_two_points():
    slope, icpt = fit([(128, 1000.0 + 1.5 * 128), (512, 1000.0 + 1.5 * 512), (1024, 2536.0)])
    assert slope == pytest.approx(1.5) and icpt == pytest.approx(1000.0)
    assert fit([(128, 1.0)]) is None


def test_the_reference_slopes_are_the_hidden_size_and_the_vocabulary_formulas():
    ref = reference_slopes([0, 1])
    # 4 layers x 8 rows x (34 x 256 + 5 x 4 x (2 s + 1)) x 4 bytes, s = 6, and the KV cache:
    # 32 rows x 4 layers x 2 x 256 x 4 bytes
    act = 4 * 8 * (34 * 256 + 5 * 4 * 13) * 4
    assert ref["hidden"] == pytest.approx((act + 32 * 4 * 2 * 256 * 4) / 2**20)
    assert ref["vocabulary"] == pytest.approx(3 * 8 * 151_936 * 4 / 2**20)  # ~13.9 MiB
    assert ref["vocabulary"] > 5 * reference_slopes([8, 256])["hidden"]


def test_the_report_gives_ratios_slope_and_says_what_did_not_fit(tmp_path):
    lines = [
        _run("chunked", 128, 1500.0, 100.0),
        _run("chunked", 1024, 3292.0, 800.0),
        _run("trl", 128, 3000.0, 150.0),
        {"side": "trl", "dtype": "fp32", "length": 1024, "why": "did not fit: over the cap"},
    ]
    (tmp_path / "runs.jsonl").write_text("\n".join(__import__("json").dumps(x) for x in lines))
    text = report(load_runs([str(tmp_path)]), str(tmp_path / "curve.png"))
    assert "| 128 | 1500 / 100.0 | 3000 / 150.0 | **0.50x**, **1.50x** |" in text
    assert "| 1024 | 3292 / 800.0 | did not fit | - |" in text
    assert "+ 2.00 MiB per response token" in text
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_modes_table_compares_steady_completions_to_sync():
    base = {"step": 10.0, "completions_per_second": 2.5, "sample_lag": 0.0, "threads": 2}
    base |= {"trainer_wait_seconds": 0.0, "rollout_utilization": 0.4, "train_utilization": 1.0}
    runs = {
        ("mode:sync", "fp32", 128): base
        | {"side": "mode:sync", "length": 128, "steady_completions_per_second": 3.2},
        ("mode:one_step_off", "fp32", 128): base
        | {"side": "mode:one_step_off", "length": 128, "steady_completions_per_second": 4.0},
    }
    text = modes_table(runs)
    assert "| one_step_off | 128 | 10.0 | 4.000 | 1.25x |" in text
    assert text.index("| sync |") < text.index("| one_step_off |")
