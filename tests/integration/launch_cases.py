"""The launch recipes' commands on simulated hosts; run by test_multinode.py inside
namespaces of its own.

``deploy/slurm/rlpost.sbatch`` runs as ``sbatch`` would run it on the first node of a
three-node job: ``srun -w NODE`` runs its command on that host of a
:class:`~tests.multinode.Bed` and ``scontrol show hostnames`` lists the job's nodes, the
scheduler's two commands the template calls; everything else (``ray start`` on each node
with token authentication, the wait for the nodes, ``rlpost train`` on the head) is the
template's own.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests import multinode

pytestmark = pytest.mark.skipif(
    not multinode.is_isolated(), reason="runs inside the namespaces test_multinode.py makes"
)

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "rlpost.sbatch"
SRUN = """#!/usr/bin/env bash
# srun on the bed: -w NODE runs the command on that host; SLURM's other options do not apply
node=
while [ $# -gt 0 ]; do
  case "$1" in
    -w|--nodelist) node=$2; shift 2 ;;
    --nodelist=*) node=${1#*=}; shift ;;
    -*) shift ;;
    *) break ;;
  esac
done
exec ip netns exec "$node" "$@"
"""
SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<<"$3"
"""


@pytest.fixture(scope="module")
def hosts():
    with multinode.Bed(3) as bed:
        yield bed


def _shims(where: Path) -> Path:
    where.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (where / name).write_text(text)
        (where / name).chmod(stat.S_IRWXU)
    return where


def test_the_sbatch_template_makes_a_cluster_of_the_job_and_trains(hosts, tmp_path):
    """Three nodes h1-h3: the head on h1 with ``trainer_node``, h2 and h3 joining with
    ``rollout_node``; the run's placement asks for those, so the trainer runs on h1 and the
    two rollout workers on the others. The run completes, one metrics row per step, and
    the template stops Ray on every node when it ends."""
    env = {
        **hosts.env,
        "PATH": f"{_shims(tmp_path / 'bin')}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "h1,h2,h3",
        "SLURM_JOB_ID": "7",
        "SLURM_CPUS_PER_TASK": "4",
        "RAY_TEMP_ROOT": str(hosts.root / "s"),  # short: Ray's sockets live there
        "RAY_START_ARGS": f"--object-store-memory={multinode.OBJECT_STORE_BYTES}",
        "HEAD_RESOURCES": json.dumps({"trainer_node": 1}),
        "WORKER_RESOURCES": json.dumps({"rollout_node": 4}),
    }
    overrides = {
        "run.output_dir": str(tmp_path),
        "run.name": "slurm",
        "run.threads": 1,
        "cluster.rollout_workers": 2,
        "cluster.trainer.resources": "{trainer_node: 1}",
        "cluster.rollout.resources": "{rollout_node: 1}",
        "data.task.max_operand": 9,
        "data.task.eval_size": 32,
        "sft.steps": 100,
        "rollout.prompts_per_step": 8,
        "rollout.n": 4,
        "train.mini_batch_size": 32,
        "train.micro_batch_size": 32,
        "train.steps": 3,
        "eval.every": 0,
        "observe.progress": "false",
        "observe.plot": "false",
    }
    argv = ["bash", str(SBATCH), *(f"{k}={v}" for k, v in overrides.items())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert f"head h1 at {hosts.address(1)}:6379, 3 nodes" in out
    rows = [json.loads(x) for x in (tmp_path / "slurm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["step"] > 0 and "loss" in r]
    assert steps == [1, 2, 3], steps
    left = [p for i in (1, 2, 3) for p in hosts.processes(i) if "ray" in p and "raylet" in p]
    assert not left, left  # the template stopped Ray on its nodes
    print(f"measured: sbatch template on 3 simulated nodes: {len(steps)} steps")
