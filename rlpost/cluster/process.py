"""Workers in OS processes of their own (multiprocessing, spawn).

A :class:`ProcessWorker` starts a child process that builds one worker from
the run's config and then serves its methods: each call is pickled over a
pipe, run in the child, and its result (or its error, in one line) pickled
back. The worker classes are unchanged: this is the proof that a Ray actor can
wrap them the same way. Arguments and results are copied (plain pickle), never
shared, so neither side can hold the other's tensors.

``start_process_workers`` puts the trainer and the rollout worker each in its
own process (so rollout and training can use different cores) and keeps the
reward worker in this one. The warm-up runs here first and is saved in the run
directory, where the trainer's process loads it.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import traceback
from pathlib import Path
from typing import Any

from rlpost.config import Config


class WorkerError(RuntimeError):
    """A worker process failed; the message names the worker, the call and the cause."""


def _serve(conn, factory: str, cfg_data: dict, run_dir: str) -> None:
    """Child side: build the worker, then answer calls until told to close."""
    try:
        import torch

        from rlpost.cluster import process as me

        cfg = Config.model_validate(cfg_data)
        torch.manual_seed(cfg.run.seed)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        worker = getattr(me, factory)(cfg, Path(run_dir))
    except Exception as exc:  # the parent reports it in one line and stops the run
        conn.send_bytes(pickle.dumps(("error", _one_line(exc))))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        name, args, kwargs = pickle.loads(conn.recv_bytes())
        try:
            result = getattr(worker, name)(*args, **kwargs)
        except Exception as exc:
            conn.send_bytes(pickle.dumps(("error", _one_line(exc))))
            if name == "close":
                return
            continue
        conn.send_bytes(pickle.dumps(("ok", result)))
        if name == "close":
            return


def _one_line(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" ({where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno})" if where else ""
    return (
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}{at}"
    )


class ProcessWorker:
    """Calls a worker in a child process as if it were local: ``proxy.method(*args)``."""

    def __init__(self, label: str, factory: str, cfg: Config, run_dir: Path) -> None:
        ctx = mp.get_context("spawn")
        self.label = label
        self._conn, child = ctx.Pipe()
        data = cfg.model_dump(mode="json")
        self._proc = ctx.Process(
            target=_serve,
            args=(child, factory, data, str(run_dir)),
            name=f"rlpost-{label}",
            daemon=True,  # never outlives the run
        )
        self._proc.start()
        child.close()
        self._timeout = cfg.cluster.start_timeout_s
        self._receive("start")

    def _receive(self, call: str) -> Any:
        deadline = self._timeout
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise WorkerError(
                    f"{self.label} worker process exited (code {self._proc.exitcode}) during {call}"
                )
            deadline -= 1.0
            if call == "start" and deadline <= 0:
                self._proc.kill()
                raise WorkerError(f"{self.label} worker did not start within {self._timeout:.0f} s")
        kind, value = pickle.loads(self._conn.recv_bytes())
        if kind == "error":
            raise WorkerError(f"{self.label} worker, {call}: {value}")
        return value

    def call(self, name: str, *args, **kwargs) -> Any:
        self._conn.send_bytes(pickle.dumps((name, args, kwargs)))
        return self._receive(name)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("close")
            except (WorkerError, OSError, EOFError):
                pass  # closing a worker that already failed: nothing left to release
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()


# ------------------------------------------------------- factories (child side)


def trainer_factory(cfg: Config, run_dir: Path):
    from rlpost.pipeline import build
    from rlpost.pipeline.rundir import warm_start

    # The warm-up ran in the parent and is in run_dir/sft_model: warm_start loads it.
    have_sft = (run_dir / "sft_model" / "config.json").is_file()
    model, tokenizer = warm_start(cfg, run_dir, [], None, skip_sft=not have_sft)
    return build.build_trainer_worker(cfg, model, tokenizer)


def rollout_factory(cfg: Config, run_dir: Path):
    from rlpost.pipeline import build

    return build.build_rollout_worker(cfg)  # weights arrive from the trainer


def start_process_workers(cfg: Config, run_dir: Path, train_prompts, console, *, resuming: bool):
    """The trainer and the rollout worker in processes of their own; the reward worker here."""
    from rlpost.pipeline import build
    from rlpost.pipeline.rundir import warm_start
    from rlpost.pipeline.workers import Workers

    if not resuming:
        warm_start(cfg, run_dir, train_prompts, console, skip_sft=False)  # saves sft_model
    trainer = ProcessWorker("trainer", "trainer_factory", cfg, run_dir)
    try:
        rollout = ProcessWorker("rollout", "rollout_factory", cfg, run_dir)
    except WorkerError:
        trainer.close()
        raise
    return Workers(trainer, rollout, build.build_reward_worker(cfg))
