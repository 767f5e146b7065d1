"""The loop with the trainer and the rollout worker each in its own OS process (spawn)
computes the same step metrics as with every worker in this process (CPU).

This is the proof that the workers' interfaces carry everything: nothing the loop
does reaches into a live model, optimizer or generator, so a Ray actor can wrap
each worker unchanged.
"""

from __future__ import annotations

import time

import pytest

from rlpost.cluster.process import ProcessWorker, start_process_workers
from rlpost.config import load_config
from rlpost.errors import WorkerError
from rlpost.pipeline.loop import train

KEYS = ("loss", "pg_loss", "reward_mean", "kl", "grad_norm", "clip_frac", "logprob_gap")


def _cfg(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.threads=1",
            "sft.steps=40",
            "sft.batch_size=32",
            "train.steps=3",
            "rollout.prompts_per_step=8",
            "rollout.n=4",
            "rollout.max_tokens=6",
            "train.mini_batch_size=16",
            "train.micro_batch_size=16",
            "train.optim.lr=3e-3",
            "algo.kl.beta=0.01",
            "eval.limit=8",
            "eval.every=2",
            "checkpoint.every=2",
            "observe.progress=false",
            "observe.plot=false",
            *extra,
        ],
    )


def test_two_processes_give_the_same_losses_as_one(tmp_path):
    local = train(_cfg(tmp_path, "local"))
    # share_cores changes the trainer's threads within a step, and so its float rounding
    spread_cfg = _cfg(tmp_path, "spread", "cluster.backend=process", "cluster.share_cores=false")
    spread = train(spread_cfg, start=start_process_workers)
    assert len(local.history) == len(spread.history) == 3
    for a, b in zip(local.history, spread.history, strict=True):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert spread.summary["eval_accuracy_end"] == local.summary["eval_accuracy_end"]
    # the checkpoint written through the worker processes resumes like any other
    assert (spread.run_dir / "checkpoints" / "step_3" / "model" / "config.json").is_file()
    assert (spread.run_dir / "checkpoints" / "step_3" / "trainer_state.pt").is_file()


def test_a_failing_worker_process_is_one_line(tmp_path):
    cfg = _cfg(tmp_path, "broken", "model.path=" + str(tmp_path / "no_such_model"))
    with pytest.raises(WorkerError) as err:
        ProcessWorker("rollout", "rollout_factory", cfg, tmp_path)
    message = str(err.value)
    assert "rollout worker, start" in message and "does not exist" in message
    assert "\n" not in message


def test_a_worker_errors_kind_crosses_the_process_boundary(tmp_path):
    """The kind is chosen where the failure happens and read where it lands: a rollout
    worker behind the weights it was sent, a failed call, a lost process."""
    from rlpost.pipeline import build
    from rlpost.types import Prompt

    cfg = _cfg(tmp_path, "kinds")
    worker = ProcessWorker("rollout-0", "rollout_factory", cfg, tmp_path)
    try:
        params = build.sampling_params(cfg, eos_token_id=0)
        with pytest.raises(WorkerError) as behind:
            worker.generate([Prompt("1+1=")], params, 1, train=True, min_version=3)
        assert (behind.value.role, behind.value.kind) == ("rollout", "behind")
        assert (
            str(behind.value) == "rollout-0 worker, generate: holds weights version 0, was sent 3"
        )
        with pytest.raises(WorkerError) as failed:
            worker.call("no_such_method")  # raises inside the child: the worker is still there
        assert failed.value.kind == "failed" and "AttributeError" in str(failed.value)
        assert worker.version() == 0
        assert "\n" not in str(failed.value)
        worker.kill()
        with pytest.raises(WorkerError) as lost:
            worker.version()
        assert (lost.value.role, lost.value.kind) == ("rollout", "lost")
    finally:
        worker.close()


def test_the_rollout_process_marks_its_running_calls_for_the_trainer(tmp_path):
    """cluster.share_cores: the count the trainer reads is the rollout process's calls in
    flight, 0 again once each has replied."""
    import multiprocessing as mp
    import threading

    from rlpost.pipeline import build
    from rlpost.types import Prompt

    cfg = _cfg(tmp_path, "marks", "rollout.max_tokens=64")
    flag = mp.get_context("spawn").RawValue("i", 0)
    worker = ProcessWorker("rollout", "rollout_factory", cfg, tmp_path, cores=flag)
    try:
        assert flag.value == 0
        params = build.sampling_params(cfg, eos_token_id=0)
        seen, done = set(), threading.Event()
        call = threading.Thread(
            target=lambda: (worker.generate([Prompt("1+1=")] * 4, params, 8), done.set())
        )
        call.start()
        while not done.is_set():
            seen.add(flag.value)
        call.join()
        assert 1 in seen and flag.value == 0
        assert worker.version() == 0 and flag.value == 0
        # killed mid-call: the call fails in one line, and the count stays up, so a trainer
        # keeps to its own threads (the safe side) instead of taking a dead process's cores
        errors = []

        def doomed():
            try:
                worker.generate([Prompt("1+1=")] * 4, params, 8)
            except WorkerError as exc:
                errors.append(exc)

        call = threading.Thread(target=doomed)
        call.start()
        while flag.value == 0 and call.is_alive():  # until the call is running
            time.sleep(0.001)
        worker.kill()
        call.join(timeout=60)
        assert not call.is_alive()
        assert len(errors) == 1 and errors[0].kind == "lost" and "\n" not in str(errors[0])
        assert flag.value >= 1
    finally:
        worker.close()
