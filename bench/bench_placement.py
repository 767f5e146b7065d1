"""Step time of the default recipe on Ray: split placement against colocated, same run.

Runs ``--steps`` RL steps of the default recipe (warm-up shortened) three ways: every
worker in this process (the baseline), Ray with split placement (a placement group per
role) and Ray with colocated placement (rollout workers in the trainers' bundles). Prints
the median step time of each and each Ray placement's ratio to the baseline. Run it where
Ray may listen only on loopback, e.g.

    unshare -n sh -c 'ip link set lo up && python bench/bench_placement.py --steps 20'
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile


def run(name: str, steps: int, out: str, extra: list[str]) -> dict:
    from rlpost.cluster import starter
    from rlpost.config import load_config
    from rlpost.pipeline.loop import train

    cfg = load_config(
        None,
        [
            f"run.output_dir={out}",
            f"run.name={name}",
            f"train.steps={steps}",
            "sft.steps=200",
            "eval.every=0",
            "eval.limit=64",
            "checkpoint.every=0",
            "observe.progress=false",
            "observe.plot=false",
            "run.threads=1",  # as each actor (one CPU each): no run oversubscribes the cores
            *extra,
        ],
    )
    result = train(cfg, start=starter(cfg))
    times = [h["step_seconds"] for h in result.history[1:]]  # the first step warms caches
    return {"median_step_s": statistics.median(times), "wall_s": result.summary["wall_seconds"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rollout-workers", type=int, default=2)
    args = p.parse_args()
    out = tempfile.mkdtemp()
    n = f"cluster.rollout_workers={args.rollout_workers}"
    rows = {
        "local": run("local", args.steps, out, ["cluster.backend=local"]),
        "ray_split": run("split", args.steps, out, ["cluster.backend=ray", n]),
        "ray_colocated": run(
            "colocated",
            args.steps,
            out,
            ["cluster.backend=ray", n, "cluster.placement=colocated"],
        ),
    }
    base = rows["local"]["median_step_s"]
    for row in rows.values():
        row["ratio_to_local"] = row["median_step_s"] / base
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
