"""Steps per second of a tiny GRPO run on a Ray cluster of 1, 2 and 3 simulated hosts.

The hosts are network namespaces on a private bridge (``tests/multinode.py``); the bench
re-runs itself inside namespaces of its own, so nothing touches the machine's network.
Every layout runs the same work: ``rlpost train`` on host 1 with one trainer and two
rollout workers, the same seeds, ``--steps`` steps. What changes is where the workers sit:

* 1 host: every worker on host 1 (weights reach the rollout workers through Ray's shared
  memory object store);
* 2 hosts: the trainer on host 1, both rollout workers on host 2;
* 3 hosts: the trainer on host 1, one rollout worker on each of hosts 2 and 3.

The hosts share this machine's cores, so more hosts add no compute: the ratio to one host
is what the simulated network and the cross-node calls cost. Prints a table: median step
time, steps/s, ratio to one host, and the bytes each host received per step. Needs root::

    python bench/bench_multinode.py --steps 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import multinode  # noqa: E402

RESOURCES = {
    1: {"trainer_node": 1, "solo": 8},
    2: {"rollout_node": 4, "pair": 8},
    3: {"rollout_node": 4},
}
LAYOUTS = {
    1: {"cluster.trainer.resources": "{solo: 1}", "cluster.rollout.resources": "{solo: 1}"},
    2: {"cluster.trainer.resources": "{trainer_node: 1}", "cluster.rollout.resources": "{pair: 1}"},
    3: {
        "cluster.trainer.resources": "{trainer_node: 1}",
        "cluster.rollout.resources": "{rollout_node: 1}",
    },
}
WORKLOAD = {
    "cluster.backend": "ray",
    "cluster.rollout_workers": 2,
    "run.threads": 1,
    "data.task.max_operand": 9,
    "data.task.eval_size": 64,
    "sft.steps": 300,
    "rollout.prompts_per_step": 16,
    "rollout.n": 4,
    "train.mini_batch_size": 64,
    "train.micro_batch_size": 64,
    "eval.every": 0,
    "checkpoint.every": 0,
    "observe.progress": "false",
    "observe.plot": "false",
}


def measure(bed, out: Path, hosts: int, steps: int) -> dict:
    before = {i: bed.received(i) for i in (1, 2, 3)}
    run = multinode.TrainRun(
        bed, out, f"hosts{hosts}", WORKLOAD, **{"train.steps": steps, **LAYOUTS[hosts]}
    )
    if run.wait(timeout=1800) != 0:
        raise SystemExit(f"the {hosts}-host run failed:\n{run.tail()}")
    rows = run.rows()
    times = [r["step_seconds"] for r in rows[2:]]  # the first steps warm caches
    received = {i: (bed.received(i) - v) / len(rows) for i, v in before.items()}
    return {
        "median_step_s": statistics.median(times),
        "steps_per_s": 1.0 / statistics.median(times),
        "sync_bytes": rows[-1]["sync_bytes"],
        "received_per_step": received,
        "accuracy_end": run.summary()["eval_accuracy_end"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    why = multinode.unavailable()
    if why:
        raise SystemExit(f"bench_multinode: {why}")
    if not multinode.is_isolated():  # again, inside namespaces of its own
        os.execvp("unshare", multinode.isolated([sys.executable, *sys.argv]))
    out = Path(tempfile.mkdtemp(prefix="bench_multinode"))
    with multinode.Bed(3) as bed:
        bed.start_ray(RESOURCES)
        rows = {k: measure(bed, out, k, args.steps) for k in (1, 2, 3)}
    base = rows[1]["steps_per_s"]
    print(f"{args.steps} steps, 16 prompts x 4 samples, 2 rollout workers, 1 trainer")
    print("hosts | median step s | steps/s | vs 1 host | KiB received per step (h1 h2 h3) | acc")
    for k, r in rows.items():
        kib = " ".join(f"{r['received_per_step'][i] / 1024:.0f}" for i in (1, 2, 3))
        print(
            f"{k:5d} | {r['median_step_s']:13.3f} | {r['steps_per_s']:7.2f} | "
            f"{r['steps_per_s'] / base:9.2f} | {kib:>34} | {r['accuracy_end']:.3f}"
        )
    print(f"weights per push: {rows[1]['sync_bytes'] / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
