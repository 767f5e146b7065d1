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

import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from rlpost.cluster.fleet import RolloutFleet, Spawner
from rlpost.cluster.health import HealthPolicy
from rlpost.config import Config
from rlpost.errors import WorkerError, typed_line
from rlpost.rng import derive


class Host:
    """The serving side of a worker elsewhere (a child process, a Ray actor): builds the
    worker from the run's config (``threads``: torch's, else ``run.threads``), then runs its
    methods by name. ``cluster.share_cores`` (``cores``, ``lend_cores``: :func:`_core_share`'s):
    the rollout process marks its running calls in ``cores``; the trainer's takes its cores
    while none runs (observe.threads.CoreShare).

    SIGTERM (a preemption notice) sets ``noticed``. A host that ``drains`` then refuses
    every new call but ``close`` with a ``draining`` :class:`WorkerError` (a rollout fleet
    re-sends it elsewhere), lets its running calls finish and exits, at the latest after
    ``cluster.drain_timeout_s``: the caller sees it gone and re-sends what did not finish."""

    def __init__(
        self,
        factory: str,
        cfg_data: dict,
        run_dir: str,
        threads: int | None = None,
        *,
        cores=None,
        lend_cores: int = 0,
        drains: bool = True,
        **kwargs,
    ) -> None:
        import torch

        from rlpost.models.loading import quiet_transformers
        from rlpost.observe.memory import bound_kernel_caches
        from rlpost.observe.threads import CoreShare, share_cores

        quiet_transformers()  # a child process starts with transformers' defaults
        bound_kernel_caches()  # a Ray actor's environment comes from its raylet
        cfg = Config.model_validate(cfg_data)
        torch.manual_seed(cfg.run.seed)
        threads = cfg.run.threads if threads is None else threads
        if threads:
            torch.set_num_threads(threads)
        if cores is not None and lend_cores:
            share_cores(CoreShare(cores, cfg.run.threads, lend_cores, torch.set_num_threads))
        self.worker = globals()[factory](cfg, Path(run_dir), **kwargs)
        self.role = factory.removesuffix("_factory")
        self.drains = drains
        self.marks = cores if not lend_cores else None  # the lending side: its calls running
        self.drain_timeout_s = cfg.cluster.drain_timeout_s
        self.noticed = False
        self.busy = 0
        self.lock = threading.Lock()
        self._closed = False
        self._closing = threading.Lock()  # the worker closes once: when asked or on leaving
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame) -> None:
        self.noticed = True
        if self.drains:
            threading.Thread(target=self._leave, daemon=True).start()

    def _leave(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                idle = self.busy == 0
            if idle:  # drained: release the worker (its engine threads) and leave now
                with contextlib.suppress(Exception):  # exiting either way; nothing to report
                    self._close()
                break
            time.sleep(0.05)
        os._exit(0)

    def admit(self, name: str) -> None:
        """Count a call in (:meth:`done` counts it out); a draining host refuses it."""
        with self.lock:
            if self.noticed and self.drains and name != "close":
                raise WorkerError(self.role, "draining", REFUSED)
            self.busy += 1

    def done(self) -> None:
        with self.lock:
            self.busy -= 1

    def run(self, name: str, args: tuple, kwargs: dict) -> Any:
        """An admitted call's result."""
        self._mark(1)
        try:
            return self._close() if name == "close" else getattr(self.worker, name)(*args, **kwargs)
        finally:
            self._mark(-1)

    def _mark(self, step: int) -> None:
        if self.marks is not None:
            with self.lock:
                self.marks.value += step

    def _close(self) -> None:
        with self._closing:
            if not self._closed:
                self._closed = True
                self.worker.close()

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.admit(name)
        try:
            return self.run(name, args, kwargs)
        finally:
            self.done()


REFUSED = "received SIGTERM; finishing its running calls, taking no new ones"


def _serve(conn, factory: str, cfg_data: dict, run_dir: str, kwargs: dict | None = None) -> None:
    """Child side: build the worker in a :class:`Host`, then answer calls until told to close.

    Calls run on a small thread pool, so a call can arrive while another runs:
    new weights reach a rollout worker while it generates (its continuous
    engine applies them between decode steps). Each caller thread on the other
    side still makes one call at a time, so calls from one thread keep their order.
    A call is admitted as it arrives, so a draining host waits for the queued ones too."""
    try:
        host = Host(factory, cfg_data, run_dir, **(kwargs or {}))
    except Exception as exc:  # the parent reports it in one line and stops the run
        role = factory.removesuffix("_factory")
        conn.send_bytes(pickle.dumps(("error", 0, _worker_error(role, exc))))
        return
    send_lock = threading.Lock()

    def run(call_id: int, name: str, args, kwargs) -> None:
        try:
            reply = ("ok", call_id, host.run(name, args, kwargs))
        except Exception as exc:
            reply = ("error", call_id, _worker_error(host.role, exc))
        with send_lock:
            conn.send_bytes(pickle.dumps(reply))
        host.done()

    conn.send_bytes(pickle.dumps(("ready", 0, None)))
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlpost-call") as pool:
        while True:
            try:
                call_id, name, args, kwargs = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the parent is gone
            try:
                host.admit(name)
            except WorkerError as refused:
                with send_lock:
                    conn.send_bytes(pickle.dumps(("error", call_id, refused)))
                continue
            if name == "close":
                pool.shutdown(wait=True)
                run(call_id, name, args, kwargs)
                return
            pool.submit(run, call_id, name, args, kwargs)


def _worker_error(role: str, exc: BaseException) -> WorkerError:
    """What the child sends back for ``exc``: a :class:`WorkerError` keeps its kind; any
    other error is a ``failed`` call, in one line with the file and line it came from."""
    if isinstance(exc, WorkerError):
        return exc
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" ({where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno})" if where else ""
    return WorkerError(role, "failed", typed_line(exc) + at)


class Proxy:
    """The caller's side of a worker elsewhere: ``proxy.method(*args)`` is
    ``proxy.call("method", *args)``; its errors name the worker (``label``) and the call."""

    label: str
    role: str

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def _lost(self, why: str) -> WorkerError:
        return WorkerError(self.role, "lost", f"{self.label} worker {why}")

    def _error(self, name: str, kind: str, message: str) -> WorkerError:
        """Call ``name``'s error (``start``: building the worker failed)."""
        return WorkerError(self.role, kind, f"{self.label} worker, {name}: {message}")


class ProcessWorker(Proxy):
    """Calls a worker in a child process as if it were local: ``proxy.method(*args)``.

    Thread-safe: several threads may call at once (each call is tagged and its
    reply routed back by a receiver thread). If the child dies, every pending
    and later call fails with a one-line :class:`WorkerError`."""

    def __init__(
        self, label: str, factory: str, cfg: Config, run_dir: Path, **factory_kwargs
    ) -> None:
        ctx = mp.get_context("spawn")
        self.label, self.role = label, factory.removesuffix("_factory")
        # close waits this long for the child: a draining one may finish its running calls
        self._close_timeout_s = cfg.cluster.drain_timeout_s + 30.0
        self._conn, child = ctx.Pipe()
        data = cfg.model_dump(mode="json")
        self._proc = ctx.Process(
            target=_serve,
            args=(child, factory, data, str(run_dir), factory_kwargs),
            name=f"rlpost-{label}",
            daemon=True,  # never outlives the run
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[str, Future]] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._await_start(cfg.cluster.start_timeout_s)
        self._receiver = threading.Thread(
            target=self._receive, name=f"rlpost-{label}-replies", daemon=True
        )
        self._receiver.start()

    def _await_start(self, timeout: float) -> None:
        waited = 0.0
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise self._lost(self._exited(" during start"))
            waited += 1.0
            if waited >= timeout:
                self._proc.kill()
                line = f"{self.label} worker did not start within {timeout:.0f} s"
                raise WorkerError(self.role, "timeout", line)
        try:
            kind, _, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(timeout=10)
            raise self._lost(self._exited(" during start")) from None
        if kind == "error":
            self._proc.join(timeout=10)
            raise self._error("start", value.kind, value.message)

    def _receive(self) -> None:
        while True:
            try:
                kind, call_id, value = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._proc.join(timeout=5)
                self._fail_all(self._exited())
                return
            with self._lock:
                name, fut = self._pending.pop(call_id)
            if kind == "error":
                fut.set_exception(self._error(name, value.kind, value.message))
            else:
                fut.set_result(value)

    def _exited(self, during: str = "") -> str:
        return f"process exited (code {self._proc.exitcode}){during}"

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._dead = why
            pending, self._pending = self._pending, {}
        for name, fut in pending.values():
            fut.set_exception(self._lost(f"{why} during {name}"))

    def call(self, name: str, *args, **kwargs) -> Any:
        return self._call(name, args, kwargs).result()

    def _call(self, name: str, args: tuple, kwargs: dict) -> Future:
        """Send one call; its future holds the reply."""
        fut: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise self._lost(f"{self._dead}; cannot call {name}")
            call_id = next(self._ids)
            self._pending[call_id] = (name, fut)
            try:
                self._conn.send_bytes(pickle.dumps((call_id, name, args, kwargs)))
            except OSError:  # the child is gone (broken pipe): the receiver reports why
                del self._pending[call_id]
                self._proc.join(timeout=5)
                raise self._lost(self._exited(f" during {name}")) from None
        return fut

    def kill(self) -> None:
        """Stop the child at once (tests use it to play a lost machine)."""
        self._proc.kill()

    def alive(self) -> bool:
        """The child runs and its pipe is open."""
        return self._dead is None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self) -> None:
        """Ask the child to finish its running calls and exit; kill it when it has not within
        the close timeout (a hung call never holds a close up longer)."""
        if self._proc.is_alive() and self._dead is None:
            deadline = time.monotonic() + self._close_timeout_s
            # a worker that failed or hangs: killed below
            with contextlib.suppress(WorkerError, OSError, EOFError, FutureTimeout):
                self._call("close", (), {}).result(timeout=self._close_timeout_s)
            self._proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=10)
        self._conn.close()


def trainer_factory(cfg: Config, run_dir: Path, dp=None):
    from rlpost.pipeline import build
    from rlpost.pipeline.rundir import warm_start

    # The warm-up ran in the parent and is in run_dir/sft_model: warm_start loads it.
    have_sft = (run_dir / "sft_model" / "config.json").is_file()
    model, tokenizer = warm_start(cfg, run_dir, [], None, skip_sft=not have_sft)
    return build.build_trainer_worker(cfg, model, tokenizer, dp=dp)


def rollout_factory(cfg: Config, run_dir: Path):
    from rlpost.pipeline import build

    return build.build_rollout_worker(cfg)  # weights arrive from the trainer


def reward_factory(cfg: Config, run_dir: Path):  # the Ray backend's reward actors
    from rlpost.pipeline import build

    return build.build_reward_worker(cfg)


class ProcessSpawner(Spawner):
    """Rollout workers in processes of their own, for a :class:`RolloutFleet`."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.starts = itertools.count()

    def start(self, index: int, old: ProcessWorker | None = None) -> ProcessWorker:
        if old is not None:
            old.close()
        cfg = slot_config(self.cfg, index, next(self.starts))
        return ProcessWorker(f"rollout-{index}", "rollout_factory", cfg, self.run_dir)

    def stop(self, handle: ProcessWorker) -> None:
        handle.close()


def slot_config(cfg: Config, index: int, start: int) -> Config:
    """The config of rollout slot ``index``'s ``start``-th worker: its own sampling seed, so
    no two workers (nor a restarted one) draw the same stream."""
    data = cfg.model_dump(mode="json")
    data["run"]["seed"] = derive(cfg.run.seed, "worker", index, start)
    return Config.model_validate(data)


def run_fleet(spawner, cfg: Config, run_dir: Path) -> RolloutFleet:
    """A fleet of ``cluster.rollout_workers`` from ``spawner``, with the run's health policy,
    events file and scale-request directory."""
    c = cfg.cluster
    return RolloutFleet(
        spawner,
        c.rollout_workers,
        policy=HealthPolicy(c.suspect_after_s, c.dead_after_s, max_restarts=c.max_restarts),
        events=run_dir / "cluster_events.jsonl",
        control=run_dir / "cluster",
        admit_timeout_s=c.start_timeout_s,
    )


def start_process_workers(cfg: Config, run_dir: Path, train_prompts, console, *, resuming: bool):
    """The trainer and the rollout worker (or a fleet of ``cluster.rollout_workers``) in
    processes of their own; the reward worker here."""
    from rlpost.pipeline import build
    from rlpost.pipeline.rundir import warm_start
    from rlpost.pipeline.workers import Workers

    if not resuming:
        warm_start(cfg, run_dir, train_prompts, console, skip_sft=False)  # saves sft_model
    flag, lend = _core_share(cfg)
    if flag is not None:
        print(
            f"rlpost: cluster.share_cores: the trainer also runs {lend} more thread"
            f"{'s' if lend != 1 else ''} while the rollout process has no call running",
            flush=True,
        )
    with console.phase("starting the trainer and rollout processes (each loads the model)"):
        trainer = start_trainers(cfg, run_dir, flag, lend)
        try:
            if cfg.cluster.rollout_workers > 1:
                rollout = run_fleet(ProcessSpawner(cfg, run_dir), cfg, run_dir)
            else:
                rollout = ProcessWorker("rollout", "rollout_factory", cfg, run_dir, cores=flag)
        except WorkerError:
            trainer.close()
            raise
    return Workers(trainer, rollout, build.build_reward_worker(cfg))


def _core_share(cfg: Config):
    """(the shared count of the rollout process's running calls, the cores it lends the
    trainer while it is 0), or (None, 0) where ``cluster.share_cores`` does not apply: one
    trainer and one rollout worker, CPU threads set, and cores beyond the trainer's."""
    from rlpost.observe.mfu import _usable_cores
    from rlpost.resolved import resolve

    c = cfg.cluster
    if not (c.share_cores and c.trainer_workers == 1 and c.rollout_workers == 1):
        return None, 0
    lend = min(cfg.run.threads, _usable_cores() - cfg.run.threads)
    if cfg.run.threads < 1 or lend < 1 or resolve(cfg).device != "cpu":
        return None, 0
    return mp.get_context("spawn").RawValue("i", 0), lend


def start_trainers(cfg: Config, run_dir: Path, cores=None, lend: int = 0):
    """One trainer process, or the trainer layout's ranks (dp x pp x tp) behind a
    :class:`TrainerGroup` (a gloo group, nccl on cuda, on a free port of 127.0.0.1).
    ``cores``, ``lend``: :func:`_core_share`'s, for the one trainer."""
    from rlpost.resolved import resolve

    facts = resolve(cfg)
    n = facts.layout.world
    if n == 1:
        return ProcessWorker(
            "trainer", "trainer_factory", cfg, run_dir, cores=cores, lend_cores=lend
        )
    from rlpost.cluster.trainer_group import TrainerGroup
    from rlpost.train.dp import DPSpec, free_port

    backend = "nccl" if facts.device == "cuda" else "gloo"
    port = free_port()

    def rank_worker(rank: int) -> ProcessWorker:
        dp = DPSpec(rank=rank, world=n, master_port=port, backend=backend)
        return ProcessWorker(f"trainer-{rank}", "trainer_factory", cfg, run_dir, dp=dp)

    # Started together: each one's start blocks until all have joined the process group.
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(rank_worker, rank) for rank in range(n)]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:  # the ones that did start are stopped: nothing outlives a failed start
        for f in futures:
            if f.exception() is None:
                f.result().kill()
                f.result().close()
        raise failed[0]
    return TrainerGroup([f.result() for f in futures])
