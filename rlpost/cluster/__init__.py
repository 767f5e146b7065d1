"""Where workers live: this process (``local``) or processes of their own (``process``).

Each backend is a ``start(cfg, run_dir, train_prompts, console, resuming) ->
Workers`` function the loop calls once its run directory exists; the loop then
drives the workers through their protocols, wherever they are. A Ray backend
is the same shape with actors.
"""

from __future__ import annotations

from collections.abc import Callable

from rlpost.config import Config


def starter(cfg: Config) -> Callable:
    """The start function of ``cfg.cluster.backend`` (``auto``: local for the synchronous loop
    with one trainer, separate processes for the overlapped ones or data-parallel trainers)."""
    backend = cfg.cluster.backend
    if backend == "auto":
        one = cfg.pipeline.mode == "sync" and cfg.cluster.trainer_workers == 1
        backend = "local" if one else "process"
    if backend == "process":
        from rlpost.cluster.process import start_process_workers

        return start_process_workers
    from rlpost.cluster.local import start_local_workers

    return start_local_workers
