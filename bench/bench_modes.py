"""Completions per second of the overlapped modes against the synchronous loop, in one run.

    python bench/bench_modes.py                       # the default job, 300 steps per mode
    python bench/bench_modes.py --steps 60 --eval-limit 100 --eval-samples 4   # shorter

Runs the default recipe (``rlpost/recipes/grpo_arith.yaml``) in ``pipeline.mode=sync``,
``one_step_off`` and ``async`` (``max_staleness=2``), same seed, one after the
other; the warm-up runs once (in the sync run) and the other modes start from its
saved policy, so every mode trains from the same weights. Prints, per mode:
held-out accuracy before and after, ``completions_per_second`` (trained
completions over the RL wall time, evaluations excluded), RL seconds, and the
ratio of completions/s to ``sync`` measured here. Run it on a quiet machine: the
modes differ in how they use the cores, so other load moves them unequally.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

MODES = [("sync", []), ("one_step_off", []), ("async", ["pipeline.max_staleness=2"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="RL steps per mode")
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out problems (default all)")
    ap.add_argument("--eval-samples", type=int, default=16, help="samples per held-out problem")
    ap.add_argument("--sft-steps", type=int, default=None, help="warm-up steps (default: recipe)")
    ap.add_argument("--out", default=None, help="run directory parent (default: a temp dir)")
    ap.add_argument("--modes", default="sync,one_step_off,async", help="comma-separated modes")
    ap.add_argument("--warm", default=None, help="a saved warm-up policy (skips the warm-up)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied to every mode")
    args = ap.parse_args()

    from rlpost.cluster import starter
    from rlpost.config import RECIPES_DIR, load_config
    from rlpost.pipeline.loop import train

    out = Path(args.out or tempfile.mkdtemp(prefix="rlpost-modes-"))
    rows, warm = [], args.warm
    chosen = args.modes.split(",")
    for mode, extra in [m for m in MODES if m[0] in chosen]:
        over = [
            f"run.output_dir={out}",
            f"run.name={mode}",
            f"train.steps={args.steps}",
            f"eval.samples={args.eval_samples}",
            "eval.every=0",
            "observe.progress=false",
            "observe.plot=false",
            f"pipeline.mode={mode}",
            *extra,
            *args.overrides,
        ]
        if args.eval_limit:
            over.append(f"eval.limit={args.eval_limit}")
        if warm is not None:
            over += [f"model.path={warm}", "sft.steps=0"]
        elif args.sft_steps is not None:
            over.append(f"sft.steps={args.sft_steps}")
        cfg = load_config(RECIPES_DIR / "grpo_arith.yaml", over)
        started = time.time()
        result = train(cfg, start=starter(cfg))
        s = result.summary
        rows.append((mode, s, time.time() - started))
        warm = warm or result.run_dir / "sft_model"
        print(json.dumps({"mode": mode, **{k: s[k] for k in SHOWN}}), flush=True)
    base = rows[0][1]["completions_per_second"]  # the first mode run (sync by default)
    print(
        f"\n{'mode':<14}{'held-out T=1':>22}{'greedy':>18}{'compl/s':>10}{'RL s':>8}{'vs ' + rows[0][0]:>9}"
    )
    for mode, s, _ in rows:
        acc = f"{s['eval_accuracy_start']:.1%} -> {s['eval_accuracy_end']:.1%}"
        greedy = f"{s['eval_greedy_accuracy_start']:.1%} -> {s['eval_greedy_accuracy_end']:.1%}"
        cps = s["completions_per_second"]
        print(
            f"{mode:<14}{acc:>22}{greedy:>18}{cps:>10.1f}{s['rl_seconds']:>8.0f}{cps / base:>8.2f}x"
        )


SHOWN = (
    "eval_accuracy_start",
    "eval_accuracy_end",
    "eval_greedy_accuracy_start",
    "eval_greedy_accuracy_end",
    "completions_per_second",
    "rl_seconds",
)

if __name__ == "__main__":
    main()
