"""Workers as Ray actors (``cluster.backend=ray``; extra ``[ray]``).

The actors build their workers with the other backends' builders and answer ``call(name,
args, kwargs)``; a :class:`RayWorker` proxy gives the loop the blocking interface it has
everywhere. Ray restarts a lost rollout actor (``cluster.max_restarts``) and the
:class:`~rlpost.cluster.fleet.RolloutFleet` syncs it in full before it serves again.

One placement group per role (split), or the rollout workers in the trainers' bundles
(colocated). A request the cluster cannot hold, or a group not placed within
``cluster.placement_timeout_s``, fails in one line naming the role and the resource.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpost.cluster.fleet import Spawner
from rlpost.cluster.process import Host, Proxy, run_fleet, slot_config
from rlpost.cluster.ray_connect import LOCAL, connect
from rlpost.config import Config, ConfigError
from rlpost.errors import WorkerError, kind_of, typed_line
from rlpost.pipeline.workers import Workers

INSTALL = 'pip install -e ".[ray]"'


class PlacementError(ConfigError):
    """A placement group the Ray cluster cannot hold; the message names role and resource."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"cluster.backend=ray needs Ray, which is not installed: {INSTALL}"
        ) from None
    return ray


class _Host(Host):
    """Actor body: a :class:`~rlpost.cluster.process.Host`; SIGTERM turns ``notice()`` True,
    and a rollout or reward host drains and exits."""

    def __init__(self, factory: str, cfg_data: dict, run_dir: str, threads: int, dp=None):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        kwargs = {} if dp is None else {"dp": dp}
        drains = factory != "trainer_factory"
        super().__init__(factory, cfg_data, run_dir, max(1, threads), drains=drains, **kwargs)

    def notice(self) -> bool:
        """True once a preemption notice (SIGTERM) arrived."""
        return self.noticed

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The id of the Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


class TrainerWorker(_Host):
    """Ray actor around the trainer worker (policy, reference, critic; one data-parallel rank)."""


class RolloutWorker(_Host):
    """Ray actor around one rollout worker (an engine and its sampling state)."""


class RewardWorker(_Host):
    """Ray actor around the reward worker (reward terms, sandbox pool, reward models)."""


def rendezvous() -> tuple[str, int]:
    """(this node's address, a free TCP port on it): where data-parallel rank 0 listens."""
    import socket

    import ray

    host = ray.util.get_node_ip_address()  # 127.0.0.1 on a local cluster (connect)
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return host, port


class RayWorker(Proxy):
    """Blocking calls to an actor: ``proxy.method(*args)``; a failure is a one-line
    :class:`WorkerError` naming the worker (``lost`` for an actor that died)."""

    def __init__(self, label: str, actor, role: str) -> None:
        self.label, self.actor, self.role = label, actor, role
        self.lost: str | None = None

    def call(self, name: str, *args, **kwargs) -> Any:
        ray = import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(self.actor.call.remote(name, args, kwargs))
        except RayActorError as exc:
            self.lost = typed_line(exc, limit=300)
            raise self._lost(f"lost during {name}: {self.lost}") from None
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise self._error(name, kind_of(cause), typed_line(cause, limit=300)) from None

    def alive(self) -> bool:
        return self.lost is None

    @property
    def pid(self) -> int:
        return import_ray().get(self.actor.pid.remote())

    def notice(self) -> bool:
        return bool(import_ray().get(self.actor.notice.remote()))

    @property
    def node(self) -> str:
        return import_ray().get(self.actor.node.remote())

    def kill(self) -> None:
        import_ray().kill(self.actor, no_restart=True)


@dataclass
class Placement:
    """Placement groups of a run and the bundle each worker goes into."""

    groups: list = field(default_factory=list)
    trainer: list[tuple[Any, int]] = field(default_factory=list)
    rollout: list[tuple[Any, int]] = field(default_factory=list)
    reward: list[tuple[Any, int]] = field(default_factory=list)


def _bundle(res) -> dict[str, float]:
    """One worker's bundle from its ``cluster.<role>`` resources."""
    b = {"CPU": res.cpus, "GPU": res.gpus, **res.resources}
    b = {k: v for k, v in b.items() if v > 0}
    return b or {"CPU": 0.001}  # Ray refuses an empty bundle


def _add(*bundles: dict[str, float]) -> dict[str, float]:
    """The resources of ``bundles`` together."""
    return {k: sum(b.get(k, 0.0) for b in bundles) for k in set().union(*bundles)}


def plan(cfg: Config) -> list[tuple[str, list[dict[str, float]], str]]:
    """[(role, bundles, strategy)] for the placement groups of ``cfg.cluster``."""
    c = cfg.cluster
    t = _bundle(c.trainer)
    r = _bundle(c.rollout)
    out = []
    if c.placement == "colocated":
        bundles = [dict(t) for _ in range(c.trainer_workers)]
        for i in range(c.rollout_workers):
            k = i % c.trainer_workers
            bundles[k] = _add(bundles[k], r)
        out.append(("trainer+rollout", bundles, "PACK"))
    else:
        out.append(("trainer", [dict(t) for _ in range(c.trainer_workers)], "PACK"))
        out.append(("rollout", [dict(r) for _ in range(c.rollout_workers)], "SPREAD"))
    if c.reward_workers:
        w = _bundle(c.reward)
        out.append(("reward", [dict(w) for _ in range(c.reward_workers)], "SPREAD"))
    return out


_KEY = {"CPU": "cpus", "GPU": "gpus"}


def check_fits(ray, role: str, bundles: list[dict[str, float]]) -> None:
    """Fail at once when the cluster cannot hold ``bundles`` (before asking Ray to place them)."""
    avail, total = ray.available_resources(), ray.cluster_resources()
    need = _add(*bundles)
    for res, amount in sorted(need.items()):
        have = avail.get(res, 0.0)
        if have + 1e-9 < amount:
            raise PlacementError(
                f"cluster placement: the {role} workers need {res} {amount:g} "
                f"({len(bundles)} x {bundles[0].get(res, 0):g}) but the Ray cluster has {have:g} "
                f"free of {total.get(res, 0.0):g}; lower {_knobs(role, res)} or add nodes"
            )
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for b in bundles:
        for res, amount in sorted(b.items()):
            if not any(node.get(res, 0.0) + 1e-9 >= amount for node in nodes):
                raise PlacementError(
                    f"cluster placement: one {role} worker needs {res} {amount:g} on a single "
                    f"node and no node of the Ray cluster has that much; lower {_knobs(role, res)}"
                )


def _knobs(role: str, res: str) -> str:
    key = _KEY.get(res, f"resources.{res}")
    roles = role.split("+")
    return " / ".join(f"cluster.{r}.{key} or cluster.{r}_workers" for r in roles)


def place(ray, cfg: Config) -> Placement:
    """The run's placement groups, each placed or failed in one line (none left behind)."""
    from ray.util.placement_group import placement_group

    c = cfg.cluster
    p = Placement()
    try:
        for role, bundles, strategy in plan(cfg):
            check_fits(ray, role, bundles)
            pg = placement_group(bundles, strategy=strategy, name=f"rlpost-{cfg.run.name}-{role}")
            p.groups.append(pg)
            ready, _ = ray.wait([pg.ready()], timeout=c.placement_timeout_s)
            if not ready:
                need = _add(*bundles)
                want = ", ".join(f"{k} {v:g}" for k, v in sorted(need.items()))
                free = ", ".join(
                    f"{k} {v:g}" for k, v in sorted(ray.available_resources().items()) if k in need
                )
                raise PlacementError(
                    f"cluster placement: the {role} placement group ({want}) was not placed "
                    f"within {c.placement_timeout_s:g} s (free: {free or 'none'}); lower "
                    f"{_knobs(role, next(iter(sorted(need))))} or add nodes"
                )
            slots = [(pg, i) for i in range(len(bundles))]
            if role == "trainer+rollout":
                p.trainer = slots
                p.rollout = [slots[i % c.trainer_workers] for i in range(c.rollout_workers)]
            else:
                setattr(p, role, slots)
    except BaseException:
        release(ray, p.groups, started_ray=False)
        raise
    return p


def release(ray, groups: list, *, started_ray: bool) -> None:
    """Remove the placement groups, and stop the Ray cluster when this run started it."""
    from ray.util.placement_group import remove_placement_group

    for pg in groups:
        remove_placement_group(pg)
    if started_ray:
        ray.shutdown()
        LOCAL.leave(ray)


def _options(pg, index: int | None, cpus: float, gpus: float, resources=None, **extra) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts = {"num_cpus": cpus, "num_gpus": gpus, **extra}
    if resources:
        opts["resources"] = dict(resources)
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        )
    return opts


class RaySpawner(Spawner):
    """Rollout actors for a :class:`RolloutFleet`. A lost actor is restarted by Ray in its
    bundle; ``start`` waits until it answers again (a new actor if Ray gave up on it)."""

    def __init__(self, ray, cfg: Config, run_dir: Path, placement: Placement) -> None:
        self.ray, self.cfg, self.run_dir, self.placement = ray, cfg, run_dir, placement
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def _slot(self, index: int):
        if index < len(self.placement.rollout):
            return self.placement.rollout[index]
        from ray.util.placement_group import placement_group

        c = self.cfg.cluster
        bundles = [_bundle(c.rollout)]
        check_fits(self.ray, "rollout", bundles)
        pg = placement_group(bundles, name=f"rlpost-{self.cfg.run.name}-rollout-{index}")
        ready, _ = self.ray.wait([pg.ready()], timeout=c.placement_timeout_s)
        if not ready:
            release(self.ray, [pg], started_ray=False)
            raise PlacementError(
                f"cluster placement: rollout worker {index} was not placed within "
                f"{c.placement_timeout_s:g} s"
            )
        self.placement.groups.append(pg)  # removed with the others when the workers close
        self.placement.rollout.append((pg, 0))
        return pg, 0

    def _leaving(self, old: RayWorker) -> bool:
        """The actor is draining after a preemption notice, or cannot be asked."""
        try:
            return bool(self.ray.get(old.actor.notice.remote(), timeout=10))
        except Exception:  # gone or unreachable: Ray's restart is what to wait for
            return True

    def start(self, index: int, old: RayWorker | None = None) -> RayWorker:
        c = self.cfg.cluster
        if old is not None and old.lost is None and not self._leaving(old):
            # its calls failed while its actor lived (a broken engine): a new actor, not it
            self.ray.kill(old.actor, no_restart=True)
        elif old is not None:  # lost or draining: Ray restarts it in its bundle
            deadline = time.monotonic() + c.start_timeout_s
            from ray.exceptions import ActorDiedError, RayActorError

            while time.monotonic() < deadline and not self.cancelled.is_set():
                try:
                    if not self.ray.get(old.actor.notice.remote(), timeout=5):
                        return RayWorker(old.label, old.actor, "rollout")  # restarted by Ray
                    self.cancelled.wait(0.5)  # still draining: it exits, then Ray restarts it
                except ActorDiedError:
                    break  # Ray gave up on it (restarts spent): a new actor below
                except (RayActorError, self.ray.exceptions.GetTimeoutError):
                    self.cancelled.wait(0.5)
            self.ray.kill(old.actor, no_restart=True)
            self._check_cancelled(index)
        worker = _actor(
            self.ray,
            f"rollout-{index}",
            slot_config(self.cfg, index, 0),
            self.run_dir,
            self._slot(index),
            max_restarts=c.max_restarts,
            max_concurrency=4,  # weights arrive while it generates
        )
        try:
            _ready(self.ray, [worker], c.start_timeout_s, self.cancelled)
        except WorkerError:
            self.ray.kill(worker.actor, no_restart=True)
            raise
        return worker

    def _check_cancelled(self, index: int) -> None:
        if self.cancelled.is_set():
            raise WorkerError("rollout", "failed", f"rollout-{index} not restarted: run closing")

    def stop(self, handle: RayWorker) -> None:
        with contextlib.suppress(WorkerError):  # already gone: nothing left to close
            handle.call("close")
        self.ray.kill(handle.actor, no_restart=True)


_ACTORS = {"trainer": TrainerWorker, "rollout": RolloutWorker, "reward": RewardWorker}


def _actor(ray, label: str, cfg: Config, run_dir: Path, slot, dp=None, **extra) -> RayWorker:
    """A new actor for worker ``label`` in bundle ``slot`` ((group, index)), with the cpus and
    gpus of ``cluster.<role>``."""
    role = label.split("-")[0]
    res = getattr(cfg.cluster, role)
    opts = _options(*slot, res.cpus, res.gpus, res.resources, **{"max_concurrency": 2, **extra})
    threads = max(1, math.floor(res.cpus))
    actor = ray.remote(_ACTORS[role]).options(**opts)
    data = cfg.model_dump(mode="json")
    return RayWorker(label, actor.remote(f"{role}_factory", data, str(run_dir), threads, dp), role)


def _ready(ray, workers: list[RayWorker], timeout: float, cancelled=None) -> None:
    """Wait until every actor is built; one line naming the one that failed or hung (or
    the first still starting once ``cancelled`` is set)."""
    from ray.exceptions import RayActorError, RayTaskError

    refs = {w.actor.pid.remote(): w for w in workers}
    deadline = time.monotonic() + timeout
    done, pending = [], list(refs)
    while pending and time.monotonic() < deadline:
        if cancelled is not None and cancelled.is_set():
            w = refs[pending[0]]
            raise WorkerError(w.role, "failed", f"{w.label} start abandoned: run closing")
        step = min(1.0, max(0.0, deadline - time.monotonic()))
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=step)
        done += more
    for ref in done:
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            raise refs[ref]._error("start", "failed", typed_line(exc, limit=300)) from None
    if pending:
        w = refs[pending[0]]
        names = ", ".join(refs[r].label for r in pending)
        line = f"{names} did not start within {timeout:.0f} s (cluster.start_timeout_s)"
        raise WorkerError(w.role, "timeout", line)


class RewardPool:
    """The reward worker interface over ``cluster.reward_workers`` actors: each scoring call's
    groups are split over them and scored concurrently (sandboxes and reward models scale out)."""

    def __init__(self, workers: list[RayWorker]) -> None:
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="reward")

    def score(self, groups, max_tokens=None, *, training: bool = True):
        k = len(self.workers)
        size = math.ceil(len(groups) / k) if groups else 0
        parts = [groups[i * size : (i + 1) * size] for i in range(k)] if size else []
        futures = [
            self.pool.submit(w.score, part, max_tokens, training=training)
            for w, part in zip(self.workers, parts, strict=False)
            if part
        ]
        return [g for f in futures for g in f.result()]

    def verifiable_accuracy(self, groups):
        return self.workers[0].verifiable_accuracy(groups)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.workers:
            for k, v in w.counters().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.pool.shutdown(wait=False)


@dataclass
class RayWorkers(Workers):
    """The run's workers on Ray; a watcher polls the trainers for a preemption notice, which
    stops the run after the current step."""

    ray: Any = None
    groups: list = field(default_factory=list)
    started_ray: bool = False
    trainers: list = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.trainers:
            threading.Thread(target=self._watch, name="rlpost-notice", daemon=True).start()

    def _watch(self) -> None:
        from rlpost.pipeline.interrupts import request_stop

        while not self._done.wait(2.0):
            for w in self.trainers:
                try:
                    noticed = w.notice()
                except Exception:  # a lost trainer is the loop's to report
                    continue
                if noticed:
                    request_stop(f"{w.label} worker received SIGTERM (preemption notice)")
                    return

    def close(self) -> None:
        self._done.set()
        try:
            super().close()
        finally:
            release(self.ray, self.groups, started_ray=self.started_ray)


def start_ray_workers(cfg: Config, run_dir: Path, train_prompts, console, *, resuming: bool):
    """Every worker a Ray actor: the trainer (or a data-parallel group of them), a fleet of
    rollout workers, the reward worker here or ``cluster.reward_workers`` actors."""
    ray = import_ray()
    from rlpost.pipeline import build
    from rlpost.pipeline.rundir import warm_start

    c = cfg.cluster
    started = connect(ray, cfg)
    placement = None
    made: list = []
    try:
        placement = place(ray, cfg)  # before the warm-up: a request that cannot fit fails now
        if not resuming:
            warm_start(cfg, run_dir, train_prompts, console, skip_sft=False)  # saves sft_model
        trainer = _start_trainers(ray, cfg, run_dir, placement, made)
        rollout = run_fleet(RaySpawner(ray, cfg, run_dir, placement), cfg, run_dir)
        made.append(rollout)
        if c.reward_workers:
            reward = RewardPool(_start_rewards(ray, cfg, run_dir, placement))
        else:
            reward = build.build_reward_worker(cfg)
    except BaseException:
        for w in reversed(made):
            with contextlib.suppress(Exception):  # tearing down: the start's own error is raised
                w.close()
        release(ray, placement.groups if placement is not None else [], started_ray=started)
        raise
    trainers = [trainer] if isinstance(trainer, RayWorker) else list(trainer.handles)
    on_ray = dict(ray=ray, groups=placement.groups, started_ray=started, trainers=trainers)
    return RayWorkers(trainer, rollout, reward, **on_ray)


def _start_trainers(ray, cfg: Config, run_dir: Path, placement: Placement, made: list):
    c = cfg.cluster
    if c.trainer_workers == 1:
        w = _actor(ray, "trainer", cfg, run_dir, placement.trainer[0])
        made.append(w)
        _ready(ray, [w], c.start_timeout_s)
        return w
    from rlpost.cluster.trainer_group import TrainerGroup
    from rlpost.train.dp import DPSpec

    where = ray.remote(rendezvous).options(**_options(*placement.trainer[0], 0, 0))
    addr, port = ray.get(where.remote())
    backend = "nccl" if c.trainer.gpus > 0 and cfg.run.device != "cpu" else "gloo"
    world = c.trainer_workers
    for i in range(world):
        spec = DPSpec(rank=i, world=world, master_addr=addr, master_port=port, backend=backend)
        made.append(_actor(ray, f"trainer-{i}", cfg, run_dir, placement.trainer[i], spec))
    _ready(ray, made[-world:], c.start_timeout_s)
    return TrainerGroup(made[-world:])


def _start_rewards(ray, cfg: Config, run_dir: Path, placement: Placement) -> list[RayWorker]:
    workers = [
        _actor(ray, f"reward-{i}", cfg, run_dir, slot) for i, slot in enumerate(placement.reward)
    ]
    _ready(ray, workers, cfg.cluster.start_timeout_s)
    return workers
