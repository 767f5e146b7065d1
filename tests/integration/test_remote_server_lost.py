"""A rollout server that dies mid-run: it leaves the rotation, and with none left the run
stops in one line naming its resume command (a checkpoint saved), never a traceback."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.conftest import small_overrides
from tests.integration.test_interrupts import _training_steps, _wait_for_a_step
from tests.integration.test_server import start_server, stop_server


def test_a_killed_server_stops_the_run_in_one_line_with_its_resume_command(tmp_path, tiny_dir):
    server, url = start_server(tiny_dir, "--max-tokens-limit", "64")
    over = small_overrides(
        tmp_path,
        **{
            "model.path": str(tiny_dir),
            "rollout.engine": "remote",
            "rollout.engine.servers": json.dumps([url]),
            "rollout.engine.server_timeout_s": 10,
            "train.steps": 400,
            "sft.steps": 0,
            "eval.every": 0,
            "checkpoint.every": 0,
        },
    )
    run_dir = tmp_path / "t"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "rlpost.cli", "train", *over],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _wait_for_a_step(trainer, run_dir)
        server.kill()  # SIGKILL: the server is gone mid-run, sockets and all
        _, err = trainer.communicate(timeout=300)
    finally:
        stop_server(server)
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlpost: ") and url in last, err
    assert last.endswith(f"continue with rlpost train --resume {run_dir}"), err
    # the step the message names is checkpointed: the last one recorded, or the one after it
    # when its update went through and the push of its weights found no server
    stopped = int(last.split("stopped at step ")[1].split()[0])
    assert stopped - _training_steps(run_dir)[-1] in (0, 1) and 1 <= stopped < 400
    assert (run_dir / "checkpoints" / f"step_{stopped}" / "state.pt").is_file()
    command = shlex.split(last.split("continue with ")[1])
    assert command == ["rlpost", "train", "--resume", str(run_dir)]


def test_a_server_that_refuses_connections_leaves_the_rotation_at_once(tiny_dir):
    """Two servers, one killed: its jobs go to the other, which serves them all; once both
    are gone, the engine stops with a WorkerError naming the last failure, without sitting
    out a cool-down."""
    import time

    from transformers import AutoTokenizer

    from rlpost.errors import WorkerError
    from rlpost.rollout.engines.protocol import SamplingParams
    from rlpost.rollout.engines.remote import RemoteEngine

    servers = [start_server(tiny_dir, "--max-tokens-limit", "64") for _ in range(2)]
    (dead, dead_url), (alive, alive_url) = servers
    engine = RemoteEngine(
        [dead_url, alive_url], AutoTokenizer.from_pretrained(tiny_dir), cooldown_s=600
    )
    params = SamplingParams(max_tokens=4, seed=1)
    try:
        dead.kill()
        dead.wait()
        out = engine.generate([[1, 2, 3]] * 6, params, n=2)
        assert len(out) == 12
        served = engine.balancer.stats()["servers"]
        assert served[dead_url]["up"] is False and served[alive_url]["completed"] == 6
        alive.kill()
        alive.wait()
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            engine.generate([[1, 2, 3]], params, n=2)
        assert (err.value.role, err.value.kind) == ("rollout", "lost")
        assert alive_url in str(err.value) and "\n" not in str(err.value)
        assert time.monotonic() - start < 60  # not the 600 s cool-down
    finally:
        engine.close()
        for proc, _ in servers:
            stop_server(proc)
