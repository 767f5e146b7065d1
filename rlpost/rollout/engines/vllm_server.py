"""A stock ``vllm serve`` as a rollout server (``rollout.engine.server=vllm``).

Generation needs nothing of rlpost on the server (:mod:`rlpost.rollout.engines.client` asks
for ``return_token_ids`` and ``logprobs=0``; ``--logprobs-mode processed_logprobs`` makes them
the tempered distribution the trainer recomputes). Weights: vLLM's own transfer engines need a
GPU on both sides; every build, CPU included, serves the development API
(``VLLM_SERVER_DEV_MODE=1``) with rlpost's worker extension (``--worker-extension-cls``). One
push, per server: ``/pause?mode=wait`` (requests in flight finish on the old weights),
``/collective_rpc`` of ``rlpost_load_weights(path, version)`` on every worker
(:mod:`rlpost.rollout.engines.vllm_worker`, answering ``[version, tensors]``),
``/reset_prefix_cache``, ``/resume``.

The file is written once per push into ``rollout.engine.weights_dir``, which the servers must
read under the same path (shared memory on one host, a shared filesystem across hosts). The
development routes carry no authentication: the servers belong on loopback or a private network.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from rlpost.errors import http_error_line
from rlpost.rollout.engines.vllm import SHM, WORKER_EXTENSION, write_weights
from rlpost.sync import SyncError, SyncStats

LOAD_METHOD = "rlpost_load_weights"


def serve_args(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """Arguments of ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``) for a
    rollout server rlpost can push weights to; run it with ``VLLM_SERVER_DEV_MODE=1`` and
    rlpost importable."""
    args = [
        "--model", model_path, "--host", host, "--port", str(port),
        "--dtype", dtype, "--seed", str(seed),
        "--enable-prefix-caching", "--enable-chunked-prefill",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",  # the request's sampling, not the checkpoint's defaults
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    return args + list(extra or [])


@dataclass(frozen=True)
class Server:
    """One ``vllm serve`` base URL (``target``, as sync failures name it)."""

    target: str


class VLLMServerSync:
    """Pushes versioned weights into ``vllm serve`` servers through their development routes.

    Quacks like :class:`~rlpost.sync.WeightSync` for the run's weight path: ``push`` returns
    the :class:`SyncStats` of the servers that committed, and raises :class:`SyncError` when
    none did."""

    def __init__(
        self,
        urls: list[str],
        *,
        weights_dir: str | None = None,
        timeout_s: float = 300.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.transports = [Server(u.rstrip("/")) for u in urls]
        default = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
        self.weights_dir = Path(weights_dir) if weights_dir else default
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self.timeout_s = timeout_s

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = list(named_tensors)
        path = write_weights(tensors, self.weights_dir)
        size = path.stat().st_size
        committed, failed = [], {}
        try:
            for server in self.transports:
                try:
                    self._load(server.target, path, version, len(tensors))
                    committed.append(server.target)
                except (httpx.HTTPError, ValueError) as exc:
                    failed[server.target] = str(exc).splitlines()[0]
        finally:
            path.unlink(missing_ok=True)  # every server has read it, or failed to
        if not committed:
            target, why = next(iter(failed.items()))
            raise SyncError("load", target, why)
        seconds = time.perf_counter() - start
        return SyncStats(
            version, seconds, size * len(committed), committed=committed, failed=failed
        )

    def _load(self, url: str, path: Path, version: int, count: int) -> None:
        self._post(f"{url}/pause", params={"mode": "wait"})
        try:
            body = {"method": LOAD_METHOD, "args": [str(path), str(version)]}
            answer = self._post(f"{url}/collective_rpc", json={**body, "timeout": self.timeout_s})
            results = answer.get("results") or []
            if not results or any(r != [version, count] for r in results):
                raise ValueError(
                    f"{url}: workers answered {results}, expected [{version}, {count}] each"
                )
            self._post(f"{url}/reset_prefix_cache")
        finally:
            self._post(f"{url}/resume")

    def _post(self, url: str, **kwargs) -> dict:
        r = self.http.post(url, **kwargs)
        if r.status_code == 404:
            why = f"start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}"
            raise ValueError(
                f"{url}: HTTP 404: not a vllm serve with its development routes; {why}"
            )
        if r.status_code >= 400:
            raise ValueError(f"{url}: HTTP {r.status_code}: {http_error_line(r)}")
        return r.json() if r.content else {}

    def restart_versions(self) -> None:
        """Nothing to tell: a server takes whichever version it is sent."""

    def close(self) -> None:
        self.http.close()


def build_sync(cfg) -> VLLMServerSync:
    """The weight push of ``rollout.engine.server=vllm`` (servers, weights_dir, sync timeout)."""
    from rlpost.rollout.engines.client import keys_from_env

    e = cfg.rollout.engine
    admin = keys_from_env(e.api_key_env, e.admin_key_env)["admin_key"]
    headers = {"Authorization": f"Bearer {admin}"} if admin else None
    return VLLMServerSync(
        list(e.servers), weights_dir=e.weights_dir, timeout_s=cfg.sync.timeout_s, headers=headers
    )
