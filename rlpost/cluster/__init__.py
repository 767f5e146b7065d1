"""Where workers live: this process (``local``), processes of their own (``process``) or Ray
actors (``ray``).

Each backend is a ``start(cfg, run_dir, train_prompts, console, resuming) ->
Workers`` function the loop calls once its run directory exists; the loop then
drives the workers through their protocols, wherever they are. Several rollout
workers form a :class:`~rlpost.cluster.fleet.RolloutFleet` behind the same
protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from rlpost.config import Config, ConfigError


def starter(cfg: Config) -> Callable:
    """The start function of ``cfg.cluster.backend`` (``auto``: local for the synchronous loop,
    separate processes for the overlapped ones)."""
    c = cfg.cluster
    backend = c.backend
    if backend == "auto":
        backend = "local" if cfg.pipeline.mode == "sync" else "process"
        if c.rollout_workers > 1:
            backend = "process"
    if backend != "ray":
        for key, value in (
            ("trainer_workers", c.trainer_workers),
            ("reward_workers", c.reward_workers),
        ):
            if value != (1 if key == "trainer_workers" else 0):
                raise ConfigError(
                    f"cluster.{key}={value} needs cluster.backend=ray (backend={c.backend})"
                )
    if backend == "local" and c.rollout_workers > 1:
        raise ConfigError(
            f"cluster.rollout_workers={c.rollout_workers} needs workers of their own: set "
            "cluster.backend=process or cluster.backend=ray"
        )
    if backend == "ray":
        from rlpost.cluster.ray_backend import import_ray, start_ray_workers

        import_ray()  # not installed: one line naming the extra, before any work

        return start_ray_workers
    if backend == "process":
        from rlpost.cluster.process import start_process_workers

        return start_process_workers
    from rlpost.cluster.local import start_local_workers

    return start_local_workers
