"""Run report: one self-contained HTML page per run directory.

``rlpost report RUN_DIR`` reads ``metrics.jsonl``, ``summary.json``, ``config.yaml`` and
``samples/step_*.jsonl`` and writes ``RUN_DIR/report.html``: the training curves as inline PNGs,
EMA-smoothed over the faded raw values (``--smooth``), the summary, the config, and sampled
completions beside their reference answers (reward curves alone do not show reward hacking).
``rlpost report RUN_A RUN_B ...`` overlays the runs in ``RUN_A/compare.html``; curves scored on
different held-out sets or rewards (:func:`differences`) are drawn apart, and an all-zero series is
left out and named. No external references: the page travels as one file. Plots use matplotlib's Agg
canvas directly (no pyplot), leaving the process-wide backend alone."""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure

from rlpost.observe.recorder import METRICS_FILE, read_metrics

REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.json"
SAMPLE_FILES_SHOWN = 6
SAMPLE_ROWS_SHOWN = 8
TEXT_CHARS_SHOWN = 2000
SAMPLE_TEXTS = ("prompt", "completion", "answer")  # a sample's columns of text; then the numbers

COMPARE_FILE = "compare.html"
DEFAULT_SMOOTHING = 0.6
UNSMOOTHED = (
    "eval_accuracy",
    "eval_greedy_accuracy",
    "lr",
)  # measured exactly, not noisy: smoothing would only lag

PLOTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward mean", ("reward_mean", "reward_std")),
    ("Held-out accuracy", ("eval_accuracy",)),
    ("Held-out accuracy (greedy)", ("eval_greedy_accuracy",)),
    ("Policy loss", ("loss",)),
    ("Gradient norm (before clipping)", ("grad_norm",)),
    ("Learning rate", ("lr",)),
    ("Entropy [nats/token]", ("entropy",)),
    ("KL to reference [nats/token]", ("kl",)),
    ("Response length [tokens]", ("response_length_mean",)),
    ("Ratio clip fraction", ("clip_frac",)),
    ("Rollout throughput [tokens/s]", ("rollout_tps",)),
    ("Weight sync [seconds]", ("sync_seconds",)),
    ("Sample lag [policy versions]", ("sample_lag",)),
    ("Sample drop ratio", ("sample_drop_ratio",)),
)
"""(title, keys) of each plot; the first key decides whether the plot is drawn."""


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where ``key`` has a finite value."""
    rows = [row for row in metrics if _finite(row.get(key))]
    return [float(row["step"]) for row in rows], [float(row[key]) for row in rows]


def _figure_html(fig: Figure, title: str) -> str:
    """``fig`` as a ``<figure>`` holding an inline PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    png = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png}"></figure>'


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's start-up debiasing (``weight`` 0: none)."""
    out, last = [], 0.0
    for i, v in enumerate(values, start=1):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**i) if weight > 0 else v)
    return out


Runs = list[tuple[str, list[dict[str, Any]]]]
"""(run name, read_metrics rows) of each run in a report."""


def _draw(ax: Any, runs: Runs, keys: tuple[str, ...], smooth: float = 0.0) -> None:
    marker = "." if max(len(_series(m, keys[0])[0]) for _, m in runs) < 50 else None
    for colour, (name, metrics) in enumerate(runs):
        steps, values = _series(metrics, keys[0])
        label = name if len(runs) > 1 else ("mean" if keys[0] == "reward_mean" else keys[0])
        style = {"color": f"C{colour}", "marker": marker}
        stderr = _stderr(metrics, steps, keys[0]) if keys[0] in UNSMOOTHED[:2] else None
        if smooth > 0 and len(values) > 2 and keys[0] not in UNSMOOTHED:
            ax.plot(steps, values, alpha=0.25, color=f"C{colour}")
            ax.plot(steps, ema(values, smooth), label=f"{label} (smoothed)", color=f"C{colour}")
        elif stderr is not None:
            label = label if len(runs) > 1 else "accuracy ± 1 s.e. over problems"
            ax.errorbar(steps, values, yerr=stderr, label=label, capsize=3, **style)
        else:
            ax.plot(steps, values, label=label, **style)
        if keys == ("reward_mean", "reward_std") and len(runs) == 1:
            band = reward_band(metrics)
            if band is not None:
                ax.fill_between(
                    band[0], band[1], band[2], alpha=0.25, label=band[3], color=f"C{colour}"
                )
    if keys[0] in UNSMOOTHED[:2]:  # a fraction: the axis never shows what it cannot be
        low, high = ax.get_ylim()
        ax.set_ylim(max(low, -0.01), min(high, 1.01))
    legend = keys[0] == "reward_mean" or (keys[0] in UNSMOOTHED[:2] and stderr is not None)
    if len(runs) > 1 or legend or smooth > 0:
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def _stderr(
    metrics: list[dict[str, Any]], steps: list[float], key: str = "eval_accuracy"
) -> list[float] | None:
    """``{key}_stderr`` at each of ``steps`` (0 where missing); None if never recorded."""
    by_step = dict(zip(*_series(metrics, f"{key}_stderr"), strict=True))
    return [by_step.get(s, 0.0) for s in steps] if by_step else None


WILSON_Z = 1.96
"""The normal quantile of a two-sided 95% interval."""


def wilson_interval(mean: float, n: float, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``mean`` over ``n`` trials (Wilson 1927, eq. 1;
    Brown, Cai and DasGupta 2001 recommend it over the normal interval). It lies in [0, 1] and keeps
    its width at a mean of 0 or 1, where mean ± std collapses to a point."""
    if n <= 0:
        return mean, mean
    denom = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(mean * (1 - mean), 0.0) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def reward_band(
    metrics: list[dict[str, Any]],
) -> tuple[list[float], list[float], list[float], str] | None:
    """(steps, low, high, legend label) of the band drawn around the reward mean.

    A reward whose every value lies in [0, 1] (``reward_min``, ``reward_max``) gets the 95% Wilson
    interval of each step's mean over its ``completions``, which stays in [0, 1] (mean ± std of a
    0/1 reward goes below 0 for a mean under 0.5; for one not 0/1 it is conservative, its variance
    being at most mean * (1 - mean)). Any other reward gets mean ± std; None when neither can."""
    rows = [r for r in metrics if _finite(r.get("reward_mean"))]
    bounded = bool(rows) and all(
        _finite(r.get("reward_min"))
        and _finite(r.get("reward_max"))
        and r["reward_min"] >= 0.0
        and r["reward_max"] <= 1.0
        and _finite(r.get("completions"))
        for r in rows
    )
    if bounded:
        bounds = [wilson_interval(r["reward_mean"], r["completions"]) for r in rows]
        label = "95% interval of the mean (Wilson)"
    elif rows and any(_finite(r.get("reward_std")) for r in rows):
        spread = [r.get("reward_std") if _finite(r.get("reward_std")) else 0.0 for r in rows]
        bounds = [
            (r["reward_mean"] - s, r["reward_mean"] + s) for r, s in zip(rows, spread, strict=True)
        ]
        label = "± std"
    else:
        return None
    steps = [float(r["step"]) for r in rows]
    return steps, [b[0] for b in bounds], [b[1] for b in bounds], label


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _plot_block(
    runs: Runs, smooth: float = 0.0, apart: Sequence[str] = ()
) -> tuple[list[str], list[str], list[str]]:
    """(``<figure>`` HTML of each drawn plot, titles skipped for lack of data, titles with a run
    left out for being zero at every step). A plot whose key belongs to a group in ``apart``
    (:data:`GROUP_OF`) gets one panel per run instead of one overlay."""
    figures, skipped, zero = [], [], []
    for title, keys in PLOTS:
        drawn = [(n, m) for n, m in runs if _series(m, keys[0])[0]]
        if not drawn:
            skipped.append(title)
            continue
        nonzero = [(n, m) for n, m in drawn if any(_series(m, keys[0])[1])]
        if len(nonzero) < len(drawn):
            zero.append(title if len(runs) == 1 else f"{title} ({_names(drawn, nonzero)})")
        panels = [(title, nonzero)] if nonzero else []
        if len(nonzero) > 1 and _group(keys[0]) in apart:
            panels = [(f"{title}: {n}", [(n, m)]) for n, m in nonzero]
        for name, shown in panels:
            fig, ax = _panel(name)
            _draw(ax, shown, keys, smooth)
            figures.append(_figure_html(fig, name))
    return figures + source_figures(runs), skipped, zero


def _names(drawn: Runs, kept: Runs) -> str:
    return ", ".join(n for n, m in drawn if not any(m is k for _, k in kept))


GROUP_OF = {"eval_": "held-out set", "reward": "reward"}
"""Metric key prefix -> what must be the same in two runs for their curves to be overlaid."""


def _group(key: str) -> str | None:
    return next((g for prefix, g in GROUP_OF.items() if key.startswith(prefix)), None)


def identity(run_dir: Path) -> dict[str, dict[str, Any]]:
    """What a run's curves measure, by group: the held-out set (the data task or sources it comes
    from, their own parameters, ``eval.limit`` and ``eval.sets``, the eval temperature, the run seed
    where it splits the rows, and the problem count ``summary.json`` records) and the reward terms
    (name, weight, params), read from ``config.yaml``."""
    path = run_dir / "config.yaml"
    cfg = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
    data, ev, summary = cfg.get("data") or {}, cfg.get("eval") or {}, _read_summary(run_dir)
    held = {f"data.{k}": data.get(k) for k in ("task", "sources")}
    held |= {f"eval.{k}": ev.get(k) for k in ("limit", "sets", "temperature")}
    if "eval_fraction" in (data.get("task") or {}):
        held["run.seed"] = (cfg.get("run") or {}).get("seed")
    held["eval problems"] = summary.get("eval_problems")
    terms = (cfg.get("reward") or {}).get("terms")
    reward = {"reward.terms": terms} if terms is not None else {}
    return {"held-out set": held if cfg else {}, "reward": reward}


def differences(run_dirs: Sequence[Path]) -> dict[str, list[str]]:
    """Group -> the keys (``key: value in run a, value in run b``) whose values differ
    between the runs; a key some run does not record is not compared."""
    ids = [(Path(d).name, identity(Path(d))) for d in run_dirs]
    out: dict[str, list[str]] = {}
    for group in ("held-out set", "reward"):
        known = [(name, i[group]) for name, i in ids if i[group]]
        for key in dict.fromkeys(k for _, i in known for k in i):
            values = [(name, i.get(key)) for name, i in known]
            if any(v != values[0][1] for _, v in values):
                told = ", ".join(f"{name}: {_fmt(v)}" for name, v in values)
                out.setdefault(group, []).append(f"{key} ({told})")
    return out


def _panel(title: str) -> tuple[Figure, Any]:
    """One report plot's figure and its titled axes."""
    fig = Figure(figsize=(5.5, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    return fig, ax


def plot_curves(metrics: list[dict[str, Any]], out_png: Path) -> None:
    """Write a PNG of reward mean and held-out accuracy against step (``metrics``:
    :func:`read_metrics` rows); a missing series is an empty panel that says so, so the file
    always exists."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    for ax, (title, keys) in zip(fig.subplots(1, 2), PLOTS[:2], strict=True):
        ax.set_title(title)
        if _series(metrics, keys[0])[0]:
            _draw(ax, [("run", metrics)], keys)
        else:
            ax.text(
                0.5, 0.5, f"no {keys[0]} recorded", ha="center", va="center", transform=ax.transAxes
            )
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)


def _read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {"summary": data}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _fmt_seconds(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _first_last(metrics: list[dict[str, Any]], key: str) -> str | None:
    values = _series(metrics, key)[1]
    return f"{values[0]:.4g} -> {values[-1]:.4g}" if values else None


def _with_stderr(metrics: list[dict[str, Any]], line: str) -> str:
    """The eval accuracy line with each end's standard error over problems, when recorded."""
    steps, values = _series(metrics, "eval_accuracy")
    stderr = _stderr(metrics, steps)
    if stderr is None:
        return line
    ends = [f"{values[i]:.4g} ± {stderr[i]:.2g}" for i in (0, -1)]
    return f"eval accuracy: {ends[0]} -> {ends[1]} (± 1 s.e. over problems)"


def summarize(run_dir: Path) -> str:
    """A short text summary: steps, reward first/last, eval accuracy, last KL, wall time. The step
    count and the reward's ends are ``summary.json``'s where it records them (the last reward there
    is the mean of the final steps), so the page and the run agree."""
    run_dir = Path(run_dir)
    metrics, summary = read_metrics(run_dir), _read_summary(run_dir)
    trained = [r["step"] for r in metrics if r["step"] > 0] or [r["step"] for r in metrics]
    steps = summary.get("steps", trained[-1] if trained else 0)
    lines = [f"run: {run_dir}", f"steps: {steps}"]
    if trained:
        lines[-1] += f" (step {trained[0]} to {trained[-1]})"
    ends = [summary.get(k) for k in ("reward_mean_first", "reward_mean_last")]
    reward = _first_last(metrics, "reward_mean")
    if all(_finite(v) for v in ends):
        reward = f"{ends[0]:.4g} -> {ends[1]:.4g} (last: mean of the final steps, summary.json)"
    lines.append(f"reward mean: {reward or 'not recorded'}")
    lines.append(f"eval accuracy: {_first_last(metrics, 'eval_accuracy') or 'not recorded'}")
    lines[-1] = _with_stderr(metrics, lines[-1])
    kl = _series(metrics, "kl")[1]
    lines.append(f"kl (last): {f'{kl[-1]:.4g} nats/token' if kl else 'not recorded'}")
    wall = summary.get("wall_seconds")
    if not isinstance(wall, int | float) and len(metrics) > 1:
        wall = float(metrics[-1]["time"]) - float(metrics[0]["time"])
    lines.append(f"wall time: {_fmt_seconds(wall) if _finite(wall) else 'unknown'}")
    return "\n".join(lines)


def _load_samples(run_dir: Path) -> tuple[list[tuple[str, list[dict[str, Any]], int]], int]:
    """([(file name, rows shown, rows in file)] of evenly spaced sample files, first and last
    included; the number of files in all)."""

    def step_of(path: Path) -> int:
        digits = path.stem.removeprefix("step_")
        return int(digits) if digits.isdigit() else -1

    files = sorted((run_dir / "samples").glob("step_*.jsonl"), key=step_of)
    shown, last = min(len(files), SAMPLE_FILES_SHOWN), len(files) - 1
    picks = sorted({round(i * last / max(shown - 1, 1)) for i in range(shown)})
    loaded = []
    for path in (files[i] for i in picks):
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        loaded.append((path.name, rows[:SAMPLE_ROWS_SHOWN], len(rows)))
    return loaded, len(files)


def _clip(text: Any) -> str:
    text = "" if text is None else str(text)
    if len(text) > TEXT_CHARS_SHOWN:
        text = text[:TEXT_CHARS_SHOWN] + f" … [{len(text) - TEXT_CHARS_SHOWN} more characters]"
    return html.escape(text)


def _samples_html(run_dir: Path) -> str:
    loaded, total = _load_samples(run_dir)
    if not loaded:
        return "<p class=note>No sampled completions (samples/step_*.jsonl) in this run.</p>"
    parts = [f"<p class=note>Showing {len(loaded)} of {total} sample files.</p>"]
    for name, rows, count in loaded:
        parts.append(
            f"<h3>{html.escape(name)} <span class=note>({len(rows)} of {count} rows)</span></h3>"
        )
        parts.append(
            "<table class=samples><tr><th>prompt</th><th>completion</th><th>reference</th>"
            "<th>score</th><th>components</th></tr>"
        )
        for row in rows:
            texts = [f"<td><pre>{_clip(row.get(k))}</pre></td>" for k in SAMPLE_TEXTS]
            numbers = [row.get("score"), row.get("components") or {}]
            cells = texts + [f"<td>{html.escape(_fmt(v))}</td>" for v in numbers]
            parts.append(f"<tr>{''.join(cells)}</tr>")
        parts.append("</table>")
    return "\n".join(parts)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 8px; }
figure { margin: 0; } figure img { width: 100%; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
pre { white-space: pre-wrap; margin: 0; max-width: 480px; font-size: 12px; }
.note { color: #666; font-size: 13px; } .warn { color: #a40; font-weight: 600; }
"""


def _summary_table(run_dirs: list[Path]) -> str:
    """One column per run; the rows are every summary key any run has."""
    summaries = [_read_summary(d) for d in run_dirs]
    if not any(summaries):
        return f"<p class=note>No {SUMMARY_FILE} in this run.</p>"
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    head = (
        ""
        if len(run_dirs) == 1
        else "<tr><th></th>"
        + "".join(f"<th>{html.escape(d.name)}</th>" for d in run_dirs)
        + "</tr>"
    )
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th>"
        + "".join(f"<td>{html.escape(_fmt(s.get(k, '')))}</td>" for s in summaries)
        + "</tr>"
        for k in keys
    )
    return f"<table>{head}{rows}</table>"


def _config_html(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return "<p class=note>No config.yaml in this run.</p>"
    return (
        f"<details><summary>{html.escape(run_dir.name)}/config.yaml (what ran)</summary>"
        f"<pre>{html.escape(path.read_text(encoding='utf-8'))}</pre></details>"
    )


def _render(run_dirs: list[Path], smooth: float = 0.0) -> str:
    runs = [(d.name, read_metrics(d)) for d in run_dirs]
    differ = differences(run_dirs) if len(run_dirs) > 1 else {}
    figures, skipped, zero = _plot_block(runs, smooth, tuple(differ))
    names = " vs ".join(html.escape(d.name) for d in run_dirs)
    title = f"rlpost run report: {names}" if len(run_dirs) == 1 else f"rlpost comparison: {names}"
    body = [f"<h1>{title}</h1>"]
    body += [f"<pre>{html.escape(summarize(d))}</pre>" for d in run_dirs]
    body.append("<h2>Curves</h2>")
    for group, keys in differ.items():
        body.append(
            f"<p class=warn>The runs' {group}s differ: {html.escape('; '.join(keys))}. "
            f"Their {group} curves measure different quantities and are drawn apart.</p>"
        )
    if smooth > 0:
        body.append(
            f"<p class=note>Training curves smoothed (EMA weight {smooth}); raw values faded.</p>"
        )
    body.append(
        f"<div class=plots>{''.join(figures)}</div>" if figures else "<p class=note>No curves.</p>"
    )
    if skipped:
        body.append(
            f"<p class=note>Not plotted (not recorded in this run): {html.escape(', '.join(skipped))}.</p>"
        )
    if zero:
        body.append(
            f"<p class=note>Zero at every step, not plotted: {html.escape(', '.join(zero))}.</p>"
        )
    body += ["<h2>Summary</h2>", _summary_table(run_dirs), "<h2>Config</h2>"]
    body += [_config_html(d) for d in run_dirs]
    body.append("<h2>Sampled completions</h2>")
    for d in run_dirs:
        body += [f"<h3>{html.escape(d.name)}</h3>"] if len(run_dirs) > 1 else []
        body.append(_samples_html(d))
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(
    run_dir: Path, *others: Path, smooth: float = DEFAULT_SMOOTHING, out: Path | None = None
) -> Path:
    """Write the report of ``run_dir`` (``RUN_DIR/report.html``), or of it and ``others``
    overlaid (``RUN_DIR/compare.html``); returns its path."""
    run_dirs = [Path(run_dir), *map(Path, others)]
    for d in run_dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"run directory {d} does not exist")
    out = Path(out) if out else run_dirs[0] / (REPORT_FILE if not others else COMPARE_FILE)
    out.write_text(_render(run_dirs, smooth), encoding="utf-8")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``rlpost report RUN_DIR [RUN_DIR ...]``: print each summary and write the HTML report."""
    parser = argparse.ArgumentParser(
        prog="rlpost report",
        description="Write RUN_DIR/report.html; several runs are overlaid in RUN_DIR/compare.html.",
    )
    parser.add_argument("run_dir", type=Path, nargs="+", help="run directories (metrics.jsonl)")
    parser.add_argument(
        "--smooth",
        type=float,
        default=DEFAULT_SMOOTHING,
        help=f"EMA weight for training curves, 0 to 0.99 (0: raw; default {DEFAULT_SMOOTHING})",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if not 0 <= args.smooth < 1:
        return _error(f"--smooth {args.smooth} must be in [0, 1)")
    for run_dir in args.run_dir:
        if not run_dir.is_dir():
            return _error(f"run directory {run_dir} does not exist")
        if not read_metrics(run_dir):
            return _error(f"{run_dir} has no steps in {METRICS_FILE}; is it a run directory?")
    path = write_report(*args.run_dir, smooth=args.smooth)
    for run_dir in args.run_dir:
        print(summarize(run_dir))
    print(f"report: {path}")
    return 0


def _error(message: str) -> int:
    print(f"rlpost report: error: {message}", file=sys.stderr)
    return 2


SOURCE_PREFIX = "source/"
SOURCE_PLOTS = (
    ("Reward by source", "reward_mean"),
    ("Accuracy by source", "accuracy"),
    ("Response length by source [tokens]", "response_length_mean"),
    ("Truncated fraction by source", "truncated_frac"),
    ("Zero-spread groups by source", "zero_spread_frac"),
)
"""(title, field) of the per-source plots: one line per ``source/<name>/<field>`` series."""


def source_figures(runs: Runs) -> list[str]:
    """``<figure>`` HTML of each per-source plot of a mixture run ([] for one source)."""
    names = sorted(
        {
            k.split("/")[1]
            for _, rows in runs
            for r in rows
            for k in r
            if k.startswith(SOURCE_PREFIX)
        }
    )
    figures = []
    for title, field in SOURCE_PLOTS if names else ():
        fig, ax = _panel(title)
        for run, rows in runs:
            for name in names:
                steps, values = _series(rows, f"source/{name}/{field}")
                label = name if len(runs) == 1 else f"{run}: {name}"
                if steps:
                    ax.plot(steps, values, marker=".", label=label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        figures.append(_figure_html(fig, title))
    return figures
