"""The launch recipes' commands on simulated hosts; run by test_multinode.py inside
namespaces of its own.

``deploy/slurm/rlpost.sbatch`` runs as ``sbatch`` would run it on the first node of a
three-node job: ``srun -w NODE`` runs its command on that host of a
:class:`~tests.multinode.Bed` and ``scontrol show hostnames`` lists the job's nodes, the
scheduler's two commands the template calls; everything else (``ray start`` on each node
with token authentication, the wait for the nodes, ``rlpost train`` on the head) is the
template's own.

``deploy/kuberay/rayjob.yaml`` runs as the KubeRay operator runs it: ``ray start`` on the
head pod and on each worker replica with the manifest's ``rayStartParams`` and its
containers' environment, then, as the sidecar submitter in the head pod does, ``ray job
submit`` of the manifest's entrypoint to the head's dashboard on localhost. The bed has no
GPUs: the entrypoint runs with its GPU counts set to 0 and the run's shape made small.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import multinode

pytestmark = pytest.mark.skipif(
    not multinode.is_isolated(), reason="runs inside the namespaces test_multinode.py makes"
)

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "rlpost.sbatch"
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
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
    with multinode.Bed(4) as bed:
        yield bed


def _shims(where: Path) -> Path:
    where.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (where / name).write_text(text)
        (where / name).chmod(stat.S_IRWXU)
    return where


SMALL = {
    "run.threads": 1,
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


def _steps(run_dir: Path) -> list[int]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["step"] > 0 and "loss" in r]


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
        **SMALL,
        "run.output_dir": str(tmp_path),
        "run.name": "slurm",
        "cluster.rollout_workers": 2,
        "cluster.trainer.resources": "{trainer_node: 1}",
        "cluster.rollout.resources": "{rollout_node: 1}",
    }
    argv = ["bash", str(SBATCH), *(f"{k}={v}" for k, v in overrides.items())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert f"head h1 at {hosts.address(1)}:6379, 3 nodes" in out
    steps = _steps(tmp_path / "slurm")
    assert steps == [1, 2, 3], steps
    left = [p for i in (1, 2, 3) for p in hosts.processes(i) if "ray" in p and "raylet" in p]
    assert not left, left  # the template stopped Ray on its nodes
    print(f"measured: sbatch template on 3 simulated nodes: {len(steps)} steps")


def _container_env(spec: dict, token: str) -> dict[str, str]:
    """A container's environment as the pod gets it (the secret's value for a secretKeyRef)."""
    env = {}
    for item in spec["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = token if ref == {"name": "ray-token", "key": "token"} else item["value"]
    return env


def _flags(params: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in params.items()]


def test_the_rayjob_manifest_runs_its_entrypoint_on_its_cluster(hosts, tmp_path):
    """Head on h1 and the worker group's replicas on h2-h4, each with the manifest's
    ``rayStartParams`` and its containers' token authentication; the entrypoint submitted
    on the head pod to the dashboard on 127.0.0.1 (which no other host reaches) runs to
    the end: one metrics row per step, on the shared run directory."""
    job = yaml.safe_load(RAYJOB.read_text())["spec"]
    cluster = job["rayClusterSpec"]
    head_spec = cluster["headGroupSpec"]
    group = cluster["workerGroupSpecs"][0]
    # the dashboard listens on the head's localhost: only a sidecar submitter reaches it
    assert job["submissionMode"] == "SidecarMode"
    head_env = _container_env(head_spec["template"]["spec"]["containers"][0], hosts.token)
    worker_env = _container_env(group["template"]["spec"]["containers"][0], hosts.token)
    assert head_env["RAY_AUTH_MODE"] == worker_env["RAY_AUTH_MODE"] == "token"
    replicas = group["replicas"]
    assert 1 + replicas <= hosts.n
    temp = hosts.root / "k"
    head = [
        "ray", "start", "--head", f"--port={multinode.PORT}",
        f"--node-ip-address={hosts.address(1)}", f"--temp-dir={temp}/h1",
        f"--object-store-memory={multinode.OBJECT_STORE_BYTES}",
        *_flags(head_spec["rayStartParams"]),
    ]  # fmt: skip
    done = subprocess.run(
        hosts.on(1, head), env={**hosts.env, **head_env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for i in range(2, 2 + replicas):
        worker = [
            "ray", "start", f"--address={hosts.head}", f"--node-ip-address={hosts.address(i)}",
            f"--temp-dir={temp}/h{i}", "--num-cpus=2",
            f"--object-store-memory={multinode.OBJECT_STORE_BYTES}",
            *_flags(group["rayStartParams"]),
        ]  # fmt: skip
        done = subprocess.run(
            hosts.on(i, worker), env={**hosts.env, **worker_env}, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
    # the dashboard (the job API) listens on the head's loopback only
    reach = "import socket; s = socket.socket(); s.settimeout(3); "
    reach += f"print(s.connect_ex(('{hosts.address(1)}', 8265)))"
    assert hosts.python(2, reach).strip() != "0"
    entry = [x for x in shlex.split(job["entrypoint"]) if not x.startswith("run.output_dir=")]
    mine = {
        **SMALL,
        "run.output_dir": str(tmp_path),
        "run.name": "kuberay",
        "cluster.trainer.gpus": 0,
        "cluster.rollout.gpus": 0,
    }
    entry += [f"{k}={v}" for k, v in mine.items()]
    submit = ["ray", "job", "submit", "--address", "http://127.0.0.1:8265", "--", *entry]
    done = subprocess.run(
        hosts.on(1, submit), env={**hosts.env, **head_env}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert _steps(tmp_path / "kuberay") == [1, 2, 3]
    hosts.run(1, ["ray", "stop", "--force"])
    print(f"measured: RayJob manifest on 1 + {replicas} simulated pods: 3 steps")
