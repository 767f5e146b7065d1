"""The report tells the truth: runs scored on other held-out sets or rewards are said to
differ and drawn apart, the header agrees with summary.json, greedy accuracy appears only
at the steps it was measured, and series that are zero throughout are left out (CPU)."""

from __future__ import annotations

import json

import yaml
from matplotlib.figure import Figure

from rlpost.observe.report import _draw, differences, summarize, write_report


def make_run(run_dir, *, max_operand=30, reward="numeric_match", kl=0.0, steps=4):
    """A run directory as ``rlpost train`` leaves it: step 0 holds the first evaluation
    (greedy included), the last step the final one, summary.json the run's own numbers."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "time": 0.0, "eval_accuracy": 0.1, "eval_greedy_accuracy": 0.2}]
    for step in range(1, steps + 1):
        rows.append({"step": step, "time": float(step), "reward_mean": 0.1 * step, "kl": kl})
    rows.append({"step": 2, "time": 2.0, "eval_accuracy": 0.3})
    rows.append({"step": steps, "time": 9.0, "eval_accuracy": 0.5, "eval_greedy_accuracy": 0.6})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run": {"seed": 0},
        "data": {"task": {"name": "arith", "max_operand": max_operand, "eval_size": 500}},
        "eval": {"limit": 4, "sets": [], "temperature": 1.0},
        "reward": {"terms": [{"name": reward, "weight": 1.0}]},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = {
        "steps": steps,
        "reward_mean_first": 0.1,
        "reward_mean_last": 0.33,
        "eval_problems": 4,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def images(page: str) -> list[str]:
    return [part.split('"')[0] for part in page.split('<img alt="')[1:]]


def test_runs_on_other_held_out_sets_and_rewards_are_said_to_differ_and_drawn_apart(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", max_operand=99, reward="exact_match")
    differ = differences([a, b])
    assert list(differ) == ["held-out set", "reward"]
    assert "max_operand" in differ["held-out set"][0] and "99" in differ["held-out set"][0]
    page = write_report(a, b).read_text()
    assert "The runs' held-out sets differ: data.task" in page
    assert "The runs' rewards differ: reward.terms" in page
    shown = images(page)
    assert {"Held-out accuracy: a", "Held-out accuracy: b", "Reward mean: a"} <= set(shown)
    assert "Held-out accuracy" not in shown  # never one overlay of two quantities


def test_runs_on_the_same_held_out_set_and_reward_are_overlaid(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", kl=0.5)
    assert differences([a, b]) == {}
    page = write_report(a, b).read_text()
    assert "differ" not in page
    assert {"Held-out accuracy", "Reward mean"} <= set(images(page))


def test_header_step_count_and_last_reward_are_the_summary_s(tmp_path):
    run = make_run(tmp_path / "a")
    text = summarize(run)
    # metrics.jsonl has rows for steps 0..4 (five); the run trained 4 steps
    assert "steps: 4 (step 1 to 4)" in text
    assert "reward mean: 0.1 -> 0.33 (last: mean of the final steps" in text


def test_greedy_accuracy_is_drawn_only_where_it_was_measured(tmp_path):
    run = make_run(tmp_path / "a")
    assert "Held-out accuracy (greedy)" in images(write_report(run).read_text())
    from rlpost.observe.recorder import read_metrics

    ax = Figure().add_subplot()
    _draw(ax, [("a", read_metrics(run))], ("eval_greedy_accuracy",))
    steps = [list(line.get_xdata()) for line in ax.get_lines()]
    assert steps == [[0.0, 4.0]]  # the start and the end, not every evaluation step


def test_a_series_zero_at_every_step_is_left_out_and_named(tmp_path):
    zero = make_run(tmp_path / "zero")
    page = write_report(zero).read_text()
    assert "KL to reference [nats/token]" not in images(page)
    assert "Zero at every step, not plotted: KL to reference [nats/token]" in page
    moving = make_run(tmp_path / "moving", kl=0.2)
    assert "KL to reference [nats/token]" in images(write_report(moving).read_text())
    both = write_report(zero, moving).read_text()
    assert "KL to reference [nats/token] (zero)" in both  # drawn for the run where it moved
    assert "KL to reference [nats/token]" in images(both)
