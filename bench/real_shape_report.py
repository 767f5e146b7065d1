"""Tables, the fitted memory slope and the plot of ``bench/bench_real_shape.py``.

Also on its own, over the ``runs.jsonl`` of earlier runs (several directories are merged,
a later run of the same side, dtype and length winning):

    python bench/real_shape_report.py /tmp/curve /tmp/trl --plot bench/results/real_shape_memory.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB, HIDDEN, LAYERS, HEADS, PROMPTS, GROUP, MICRO = 151_936, 256, 4, 4, 4, 8, 8
MIB = 2**20


def load_runs(dirs: list[str]) -> dict:
    runs: dict = {}
    for d in dirs:
        path = Path(d) / "runs.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            r = json.loads(line)
            runs[(r["side"], r["dtype"], r["length"])] = r
    return runs


def best(runs: dict, side: str, length: int, key: str) -> float | None:
    """The side's best (lowest) value of ``key`` over the dtypes run at ``length``."""
    vals = [r[key] for (s, _, n), r in runs.items() if s == side and n == length and key in r]
    return min(vals) if vals else None


def why(runs: dict, side: str, length: int) -> str:
    whys = [r.get("why", "") for (s, _, n), r in runs.items() if s == side and n == length]
    return next((w.split(":")[0] for w in whys if w), "not run")


def table(runs: dict, lengths: list[int], sides: list[str]) -> str:
    """Per length: each side's peak RSS and step, and the ratios (memory a/b, speed b/a)."""
    head = "| tokens | " + " | ".join(f"{s} peak MiB / step s" for s in sides)
    pairs = (("chunked", "full"), ("chunked", "trl"), ("checkpointed", "trl"))
    ratios = [(a, b) for a, b in pairs if {a, b} <= set(sides)]
    head += "".join(f" | {a} / {b} memory, speed" for a, b in ratios) + " |"
    lines = [head, "|" + " --- |" * (1 + len(sides) + len(ratios))]
    for n in lengths:
        cells = []
        for s in sides:
            m, t = best(runs, s, n, "peak_rss_mib"), best(runs, s, n, "step")
            cells.append(why(runs, s, n) if m is None else f"{m:.0f} / {t:.1f}")
        for a, b in ratios:
            ma, mb = best(runs, a, n, "peak_rss_mib"), best(runs, b, n, "peak_rss_mib")
            ta, tb = best(runs, a, n, "step"), best(runs, b, n, "step")
            ok = None not in (ma, mb, ta, tb)
            cells.append(f"**{ma / mb:.2f}x**, **{tb / ta:.2f}x**" if ok else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares line (slope, intercept) through ``points``; None under two points."""
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


PROMPT_TOKENS = 6
"""The default job's prompts: 4-6 characters ("16+9=") and BOS, one token each."""


def hidden_estimate_mib(tokens: int) -> float:
    """What grows with the response on the chunked path, from the formulas of the memory
    preflight (``rlpost/pipeline/memory.py``): one micro-batch's activations (Korthikanti et
    al. 2022, eq. 2, ``s b (34 h + 5 a s)`` values per layer, float32 here) and the engine's
    KV cache of every row (``rows x s x L x 2 h`` float32 values), at ``s`` = prompt +
    response. The vocabulary is not in it: the head holds one chunk whatever ``s``."""
    s = PROMPT_TOKENS + tokens
    act = LAYERS * MICRO * s * (34 * HIDDEN + 5 * HEADS * s) * 4 / 2 * 2  # fp32: twice 2 bytes
    kv = PROMPTS * GROUP * s * LAYERS * 2 * HIDDEN * 4
    return (act + kv) / MIB


def reference_slopes(lengths: list[int]) -> dict[str, float]:
    """MiB per response token of the two candidates for what sets the slope, over
    ``lengths``: hidden, the least-squares slope of :func:`hidden_estimate_mib` (its
    ``5 a s`` attention term makes it grow a little with ``s``); vocabulary, the slope the
    unchunked path's logits, their float32 copy and their gradient would add,
    ``3 x MICRO x V`` float32 values per token."""
    line = fit([(n, hidden_estimate_mib(n)) for n in lengths])
    hidden = line[0] if line else hidden_estimate_mib(1) - hidden_estimate_mib(0)
    return {"hidden": hidden, "vocabulary": 3 * MICRO * VOCAB * 4 / MIB}


def slope_note(runs: dict, lengths: list[int], side: str = "chunked") -> str:
    pts = [(n, best(runs, side, n, "peak_rss_mib")) for n in lengths]
    pts = [(n, m) for n, m in pts if m is not None]
    line, ref = fit(pts), reference_slopes([n for n, _ in pts])
    if line is None:
        return f"{side}: fewer than two lengths measured, no slope"
    slope, icpt = line
    return (
        f"{side} peak RSS ~ {icpt:,.0f} MiB + {slope:.2f} MiB per response token "
        f"(fit over {', '.join(str(n) for n, _ in pts)} tokens); the hidden-size estimate "
        f"over the same lengths is {ref['hidden']:.2f} MiB/token (activations of a "
        f"micro-batch of {MICRO} and the KV cache of {PROMPTS * GROUP} rows at hidden "
        f"{HIDDEN}, {LAYERS} layers), the vocabulary-driven one {ref['vocabulary']:.1f} "
        f"MiB/token (the [{MICRO}, T, {VOCAB:,}] logits, copy and gradient): measured / "
        f"hidden {slope / ref['hidden']:.2f}x, measured / vocabulary "
        f"{slope / ref['vocabulary']:.3f}x"
    )


def plot(runs: dict, lengths: list[int], sides: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in sides:
        pts = [(n, best(runs, s, n, "peak_rss_mib")) for n in lengths]
        pts = [(n, m) for n, m in pts if m is not None]
        if not pts:
            continue
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{s} (measured)")
        line = fit(pts) if s == "chunked" else None
        if line is not None:
            xs = [min(lengths), max(lengths)]
            ax.plot(
                xs,
                [line[1] + line[0] * x for x in xs],
                ":",
                color="grey",
                label=f"chunked fit: {line[0]:.2f} MiB/token",
            )
            ref = reference_slopes(lengths)["vocabulary"]
            x0, y0 = pts[0]
            ax.plot(
                xs,
                [y0 + ref * (x - x0) for x in xs],
                "--",
                color="red",
                alpha=0.5,
                label=f"if the vocabulary set it: {ref:.1f} MiB/token",
            )
    for s in sides:  # where a side did not fit or was skipped, say so at its length
        for n in lengths:
            if best(runs, s, n, "peak_rss_mib") is None and why(runs, s, n) != "not run":
                ax.annotate(
                    f"{s}: {why(runs, s, n)} at {n}",
                    (n, 0),
                    xytext=(0, 8),
                    textcoords="offset points",
                    ha="right",
                    fontsize=8,
                )
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1])
    measured = [r["peak_rss_mib"] for r in runs.values() if "peak_rss_mib" in r]
    if measured:
        ax.set_ylim(0, max(measured) * 1.6)
    ax.set_xlabel("response tokens")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title(
        f"vocab {VOCAB:,}, hidden {HIDDEN}, {LAYERS} layers; GRPO {PROMPTS} x {GROUP}, "
        f"micro {MICRO}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def modes_table(runs: dict) -> str:
    rows = [r for (s, _, _), r in sorted(runs.items()) if s.startswith("mode:")]
    order = {"mode:sync": 0, "mode:one_step_off": 1, "mode:async": 2}
    rows.sort(key=lambda r: order.get(r["side"], 9))
    base = next((r for r in rows if r["side"] == "mode:sync" and "step" in r), None)
    lines = [
        "| mode | tokens | steady step s | completions/s (steady) | vs sync | completions/s "
        "(summary) | sample lag | trainer wait s | rollout util | train util | threads |",
        "|" + " --- |" * 11,
    ]
    for r in rows:
        name = r["side"][5:]
        if "step" not in r:
            lines.append(f"| {name} | {r['length']} | {r.get('why', '')} |" + " - |" * 8)
            continue
        cps = r["steady_completions_per_second"]
        vs = f"{cps / base['steady_completions_per_second']:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r['length']} | {r['step']:.1f} | {cps:.3f} | {vs} | "
            f"{r['completions_per_second']:.3f} | {r['sample_lag']:.2f} | "
            f"{r['trainer_wait_seconds']:.1f} | {r['rollout_utilization']:.2f} | "
            f"{r['train_utilization']:.2f} | {r['threads']} |"
        )
    return "\n".join(lines)


def report(runs: dict, plot_path: str = "") -> str:
    lengths = sorted({n for (s, _, n) in runs if not s.startswith("mode:")})
    sides = [s for s in ("full", "chunked", "checkpointed", "trl") if any(k[0] == s for k in runs)]
    parts = []
    if lengths:
        parts += [table(runs, lengths, sides), slope_note(runs, lengths)]
    if any(k[0].startswith("mode:") for k in runs):
        parts.append(modes_table(runs))
    if plot_path and lengths:
        plot(runs, lengths, sides, plot_path)
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="directories holding runs.jsonl")
    ap.add_argument("--plot", default="", help="PNG path for peak memory against length")
    args = ap.parse_args()
    print(report(load_runs(args.dirs), args.plot))


if __name__ == "__main__":
    main()
