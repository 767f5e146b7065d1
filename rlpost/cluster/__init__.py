"""Where workers live: this process (``local``), processes of their own (``process``) or Ray
actors (``ray``).

Each backend is ``start(cfg, run_dir, train_prompts, console, resuming) -> Workers``.
"""

from __future__ import annotations

from collections.abc import Callable

import rlpost.pipeline  # noqa: F401  (registers the engines the run facts read)
from rlpost.config import Config
from rlpost.resolved import resolve


def starter(cfg: Config) -> Callable:
    """The start function of ``cfg.cluster.backend`` (``auto``: local for the synchronous loop,
    separate processes for the overlapped ones)."""
    backend = resolve(cfg).backend
    if backend == "ray":
        from rlpost.cluster.ray_backend import import_ray, start_ray_workers

        import_ray()  # not installed: one line naming the extra, before any work

        return start_ray_workers
    if backend == "process":
        from rlpost.cluster.process import start_process_workers

        return start_process_workers
    from rlpost.pipeline.loop import start_workers  # local: plain objects in this process

    return start_workers
