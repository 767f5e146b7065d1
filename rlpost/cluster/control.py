"""``rlpost cluster``: talk to a running job's rollout fleet through its run directory.

    rlpost cluster scale --rollout N RUN_DIR [--wait SECONDS]
    rlpost cluster status RUN_DIR

The job's fleet watches ``RUN_DIR/cluster/scale.json`` and answers in
``RUN_DIR/cluster/fleet.json`` (plain files: a shared run directory is all a
cluster needs, no port to open). New workers are synced to the current weights
before they serve; removed ones stop taking prompts and what they ran is re-sent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

from rlpost.cluster.fleet import FLEET_STATE, SCALE_REQUEST
from rlpost.statefile import atomic_write


def _fail(message: str) -> int:
    print(f"rlpost cluster: error: {message}", file=sys.stderr)
    return 2


def _control(run_dir: str) -> Path | None:
    control = Path(run_dir) / "cluster"
    return control if (control / FLEET_STATE).is_file() else None


def _line(state: dict) -> str:
    workers = state.get("workers", [])
    healthy = [w for w in workers if w["state"] == "healthy"]
    others = [
        f"{w['worker']}:{w['state']}" for w in workers if w["state"] not in ("healthy", "retired")
    ]
    text = f"{len(healthy)} rollout workers healthy at weight version {state.get('version')}"
    if others:
        text += f"; {', '.join(others)}"
    return text + ("" if state.get("running", True) else " (the job has ended)")


def scale(run_dir: str, rollout: int, wait: float) -> int:
    if rollout < 1:
        return _fail(f"--rollout {rollout}: a job needs at least one rollout worker")
    control = _control(run_dir)
    if control is None:
        return _fail(
            f"{run_dir} has no running rollout fleet (cluster/{FLEET_STATE}); start the job with "
            "cluster.backend=process or ray"
        )
    if not json.loads((control / FLEET_STATE).read_text()).get("running", True):
        return _fail(f"the job of {run_dir} has ended; nothing to scale")
    ident = uuid.uuid4().hex
    with atomic_write(control / SCALE_REQUEST, "w") as fh:
        fh.write(json.dumps({"rollout": rollout, "id": ident}))
    deadline = time.monotonic() + wait
    while True:
        try:
            state = json.loads((control / FLEET_STATE).read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("id") == ident:
            if state.get("error"):
                return _fail(f"scale to {rollout}: {state['error']}")
            print(f"rlpost cluster: {_line(state)}")
            return 0
        if time.monotonic() >= deadline:
            if wait > 0:
                return _fail(f"the job did not answer within {wait:g} s (is it still running?)")
            print(f"rlpost cluster: asked {run_dir} for {rollout} rollout workers")
            return 0
        time.sleep(0.5)


def status(run_dir: str) -> int:
    control = _control(run_dir)
    if control is None:
        return _fail(f"{run_dir} has no rollout fleet (cluster/{FLEET_STATE})")
    print(f"rlpost cluster: {_line(json.loads((control / FLEET_STATE).read_text()))}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlpost cluster", description="a running job's workers")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("scale", help="grow or shrink the rollout fleet of a running job")
    sp.add_argument("run_dir")
    sp.add_argument("--rollout", type=int, required=True, help="rollout workers wanted")
    sp.add_argument(
        "--wait", type=float, default=600.0, help="seconds to wait for the job's answer (0: none)"
    )
    sp = sub.add_parser("status", help="the rollout workers of a job and their state")
    sp.add_argument("run_dir")
    args = p.parse_args(argv)
    if args.command == "scale":
        return scale(args.run_dir, args.rollout, args.wait)
    return status(args.run_dir)
