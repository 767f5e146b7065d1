"""Run report: HTML content, escaping, skipped plots, text summary, CLI exit codes (CPU)."""

from __future__ import annotations

import json
import math

import matplotlib.image
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from rlpost.observe.recorder import Recorder
from rlpost.observe.report import (
    _draw,
    ema,
    main,
    plot_curves,
    reward_band,
    summarize,
    wilson_interval,
    write_report,
)


def make_run(run_dir, *, steps=12, samples=True, summary=True):
    with Recorder(run_dir) as rec:
        for step in range(1, steps + 1):
            rec.record(
                step,
                {
                    "reward_mean": 0.1 + 0.05 * step,
                    "reward_std": 0.2,
                    "kl": 0.01 * step,
                    "response_length_mean": 30 - step,
                    "loss": math.nan if step == 3 else 1.0 / step,
                },
            )
            if step % 4 == 0:
                rec.record(step, {"eval_accuracy": 0.05 * step})
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({"final_accuracy": 0.6, "algo": "grpo"}))
    if samples:
        (run_dir / "samples").mkdir()
        for step in (1, 12):
            row = {
                "prompt": "What is 2+3? <script>alert('x')</script>",
                "completion": "<b>5</b> & done",
                "score": 1.0,
                "components": {"correct": 1.0},
                "answer": "#### 5",
            }
            (run_dir / "samples" / f"step_{step:06d}.jsonl").write_text(json.dumps(row) + "\n")


def test_report_is_self_contained_with_plots_tables_and_escaped_samples(tmp_path):
    make_run(tmp_path)
    page = write_report(tmp_path).read_text()
    assert page.startswith("<!doctype html>")
    assert f"<title>rlpost run report: {tmp_path.name}</title>" in page
    # reward, accuracy, KL, length are present; the rest are listed as skipped
    assert page.count('<img alt="') == 5  # reward, accuracy, loss, KL, length
    assert page.count("data:image/png;base64,") == 5
    assert "Not plotted (not recorded in this run): Held-out accuracy (greedy), Gradient" in page
    assert "Ratio clip fraction" in page.split("Not plotted")[1]
    assert "<th>final_accuracy</th><td>0.6</td>" in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<script>" not in page and "<b>5</b>" not in page
    assert "&lt;b&gt;5&lt;/b&gt; &amp; done" in page
    assert "step_000001.jsonl" in page and "step_000012.jsonl" in page
    assert "http://" not in page and "https://" not in page


def test_report_says_what_is_missing(tmp_path):
    make_run(tmp_path, samples=False, summary=False)
    page = write_report(tmp_path).read_text()
    assert "No summary.json in this run." in page
    assert "No sampled completions" in page


def test_summary_text_has_steps_reward_accuracy_kl_and_wall_time(tmp_path):
    make_run(tmp_path)
    text = summarize(tmp_path)
    assert "steps: 12 (step 1 to 12)" in text
    assert "reward mean: 0.15 -> 0.7" in text
    assert "eval accuracy: 0.2 -> 0.6" in text
    assert "kl (last): 0.12 nats/token" in text
    assert "wall time: 0m 00s" in text


def test_plot_curves_writes_a_png_even_without_accuracy(tmp_path):
    out = tmp_path / "nested" / "curves.png"
    plot_curves([{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": None}], out)
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 100 and image.shape[1] > 300
    assert image[..., :3].std() > 0.01  # not a blank canvas


def test_cli_writes_report_and_prints_summary(tmp_path, capsys):
    make_run(tmp_path)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "steps: 12" in out and f"report: {tmp_path / 'report.html'}" in out
    assert (tmp_path / "report.html").exists()


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_cli_refuses_missing_or_empty_run_dir_with_one_line(tmp_path, capsys, kind):
    run_dir = tmp_path / "nope" if kind == "missing" else tmp_path
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlpost report: error: ") and err.count("\n") == 1
    assert not (tmp_path / "report.html").exists()


def test_cli_without_arguments_exits_2(capsys):
    assert main([]) == 2
    assert "run_dir" in capsys.readouterr().err


def test_ema_smoothing_is_debiased_and_zero_is_raw():
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert ema([0.0, 10.0], 0.5) == pytest.approx([0.0, 10.0 * 0.5 / 0.75])
    assert ema([3.0, 1.0], 0.0) == [3.0, 1.0]


def test_report_shows_reference_answers_config_and_smoothing(tmp_path):
    make_run(tmp_path)
    (tmp_path / "config.yaml").write_text("algo: {advantage: grpo}\n")
    page = write_report(tmp_path, smooth=0.8).read_text()
    assert "<th>reference</th>" in page and "<pre>#### 5</pre>" in page
    assert "algo: {advantage: grpo}" in page
    assert "smoothed (EMA weight 0.8)" in page
    assert "smoothed" not in write_report(tmp_path, smooth=0.0).read_text()


def test_several_runs_are_overlaid_in_one_comparison(tmp_path, capsys):
    a, b = tmp_path / "grpo", tmp_path / "dapo"
    make_run(a)
    make_run(b, steps=6, samples=False)
    assert main([str(a), str(b), "--smooth", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.count("steps: ") == 2 and f"report: {a / 'compare.html'}" in out
    page = (a / "compare.html").read_text()
    assert "<title>rlpost comparison: grpo vs dapo</title>" in page
    assert "<tr><th></th><th>grpo</th><th>dapo</th></tr>" in page
    assert page.count('<img alt="') == 5  # one set of axes per metric, both runs on it
    assert "<h3>dapo</h3>" in page and not (b / "compare.html").exists()
    assert main([str(a), "--smooth", "1.5"]) == 2


def zero_one_rows(means, n=16):
    """Rows of a 0/1 reward: ``round(mean * n)`` ones among ``n`` samples each step."""
    rows = []
    for step, mean in enumerate(means, start=1):
        ones = round(mean * n)
        xs = [1.0] * ones + [0.0] * (n - ones)
        m = sum(xs) / n
        std = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
        rows.append(
            {"step": step, "reward_mean": m, "reward_std": std, "completions": float(n)}
            | {"reward_min": min(xs), "reward_max": max(xs)}
        )
    return rows


def test_a_zero_one_reward_gets_a_band_inside_0_1_named_in_the_legend():
    rows = zero_one_rows([0.0, 1 / 16, 0.25, 0.5, 0.9375, 1.0])
    assert any(r["reward_mean"] - r["reward_std"] < 0 for r in rows)  # what ± std drew
    steps, low, high, label = reward_band(rows)
    assert steps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert all(
        0.0 <= lo <= r["reward_mean"] <= hi <= 1.0
        for lo, hi, r in zip(low, high, rows, strict=True)
    )
    assert low[0] == 0.0 and high[0] > 0.1  # all wrong: still uncertain about the rate
    assert "Wilson" in label
    fig = Figure()
    ax = fig.add_subplot()
    _draw(ax, [("run", rows)], ("reward_mean", "reward_std"))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mean", label]


def test_wilson_interval_matches_the_hand_computed_value():
    z2 = 1.96**2
    assert wilson_interval(0.0, 16) == (0.0, pytest.approx((z2 / 16) / (1 + z2 / 16)))
    lo, hi = wilson_interval(0.5, 100)
    half = 1.96 * math.sqrt(0.25 / 100 + z2 / 40000) / (1 + z2 / 100)
    assert (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    assert wilson_interval(0.3, 0) == (0.3, 0.3)


def test_a_reward_outside_0_1_keeps_the_std_band():
    rows = zero_one_rows([0.25, 0.5])
    rows[1]["reward_min"] = -1.0  # a length penalty, say
    _, low, _, label = reward_band(rows)
    assert label == "± std"
    assert low[0] == pytest.approx(rows[0]["reward_mean"] - rows[0]["reward_std"])
    del rows[0]["reward_min"]  # a run recorded before reward_min existed: range unknown
    assert reward_band(rows)[3] == "± std"
    assert reward_band([{"step": 1, "reward_mean": 0.5}]) is None


def test_held_out_accuracy_has_error_bars_in_the_plot_and_the_summary(tmp_path):
    rows = [
        {"step": 0, "eval_accuracy": 0.1, "eval_accuracy_stderr": 0.02},
        {"step": 5, "eval_accuracy": 0.4, "eval_accuracy_stderr": 0.035},
    ]
    fig = Figure()
    ax = fig.add_subplot()
    _draw(ax, [("run", rows)], ("eval_accuracy",))
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 1
    segments = bars[0].lines[2][0].get_segments()
    assert [(s[0][1], s[1][1]) for s in segments] == [
        pytest.approx((0.08, 0.12)),
        pytest.approx((0.365, 0.435)),
    ]
    assert "s.e." in ax.get_legend().get_texts()[0].get_text()
    with Recorder(tmp_path) as rec:
        for row in rows:
            rec.record(row["step"], {k: v for k, v in row.items() if k != "step"})
    assert "eval accuracy: 0.1 ± 0.02 -> 0.4 ± 0.035" in summarize(tmp_path)
