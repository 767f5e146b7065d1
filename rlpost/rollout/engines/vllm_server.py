"""A stock ``vllm serve`` as a rollout server (``rollout.engine.server=vllm``).

Generation needs nothing of rlpost on the server (the client asks for ``return_token_ids`` and
``logprobs=0``; ``--logprobs-mode processed_logprobs`` gives the tempered distribution the trainer
recomputes). Weights go through the development API (``VLLM_SERVER_DEV_MODE=1``, any build, CPU
included; vLLM's transfer engines need GPUs) with rlpost's ``--worker-extension-cls``. One push, per
server: ``/pause?mode=wait``, ``/collective_rpc`` of ``rlpost_load_weights(url, version, token)`` on
every worker (:mod:`~rlpost.rollout.engines.vllm_worker`), ``/reset_prefix_cache``, ``/resume``. The
file is written once per push; the trainer serves it, for the push only, under a random 192-bit path
(:class:`WeightFiles`). The routes carry no authentication: the loader takes only what the admin key
(``RLPOST_WEIGHTS_KEY``) signed, from ``RLPOST_WEIGHTS_FROM``, but anyone reaching them can pause
the server or reset its cache, so keep it on loopback or a private network."""

from __future__ import annotations

import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import torch

from rlpost.config import ConfigError
from rlpost.errors import http_error_line
from rlpost.rollout.engines.vllm import SHM, WORKER_EXTENSION, write_weights
from rlpost.rollout.engines.vllm_worker import FROM_ENV, KEY_ENV, sign
from rlpost.sync import SyncError, SyncStats
from rlpost.sync.listen import local_address_towards

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
    """Arguments of ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``) for a rollout
    server rlpost can push weights to; run it with ``VLLM_SERVER_DEV_MODE=1`` and rlpost importable.
    """
    args = [
        "--model",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",  # the request's sampling, not the checkpoint's defaults
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    return args + list(extra or [])


@dataclass(frozen=True)
class Server:
    """One ``vllm serve`` base URL (``target``, as sync failures name it)."""

    target: str


class WeightFiles:
    """Weight files offered over HTTP on one address, each under a random path while offered.

    A handful of servers each fetch one file per push, so the standard library's threaded server
    does; any other path is a 404. It listens only during a push (a new port each), closes
    connections past ``max_connections`` at once, and closes one idle for ``timeout_s``, so idle
    connections cannot hold the trainer's threads."""

    def __init__(self, host: str, *, timeout_s: float = 30.0, max_connections: int = 16) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.offered: dict[str, Path] = {}
        self.slots = threading.BoundedSemaphore(max_connections)
        self.httpd: ThreadingHTTPServer | None = None

    def _listen(self) -> ThreadingHTTPServer:
        offered, slots, timeout_s = self.offered, self.slots, self.timeout_s
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        class Handler(BaseHTTPRequestHandler):
            timeout = timeout_s  # on the socket: a silent or stalled peer is cut off

            def do_GET(self) -> None:
                path = offered.get(self.path.lstrip("/"))
                if path is None:
                    self.send_error(404)
                    return
                with open(path, "rb") as f:
                    self.send_response(200)
                    self.send_header("Content-Length", str(path.stat().st_size))
                    self.end_headers()
                    shutil.copyfileobj(f, self.wfile, 1 << 20)

            def log_message(self, *args) -> None:
                """Silent: a request per push is not news."""

        class Served(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            request_queue_size = 128  # a burst is accepted, then refused or served

            def handle_error(self, *_) -> None:
                """A server that drops the connection mid-file fails its load, reported by
                the push."""

            def process_request(self, request, client_address) -> None:
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)  # full: refused, never queued on a thread
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        httpd = Served((self.host, 0), Handler)
        # polled often: closing it ends every push, and waits for one poll
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        return httpd

    def offer(self, token: str, path: Path) -> str:
        if self.httpd is None:
            self.httpd = self._listen()
        self.offered[token] = path
        bound = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{bound}:{self.httpd.server_address[1]}/{token}"

    def withdraw(self, token: str) -> None:
        self.offered.pop(token, None)
        if not self.offered:
            self.close()

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


class VLLMServerSync:
    """Pushes versioned weights into ``vllm serve`` servers through their development routes.

    Quacks like :class:`~rlpost.sync.WeightSync`: ``push`` returns the :class:`SyncStats` of the
    servers that committed, :class:`SyncError` when none did. ``key`` (the servers'
    ``RLPOST_WEIGHTS_KEY``) signs each push and goes as a Bearer token (``headers``) for a proxy."""

    def __init__(
        self,
        urls: list[str],
        *,
        key: str,
        timeout_s: float = 300.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.transports = [Server(u.rstrip("/")) for u in urls]
        self.weights_dir = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self.key, self.timeout_s = key, timeout_s
        # server -> the WeightFiles on this machine's address facing it
        self.files: dict[str, WeightFiles] = {}
        served: dict[str, WeightFiles] = {}
        for server in self.transports:
            host = urlsplit(server.target).hostname or ""
            try:
                address = local_address_towards(host)
            except OSError as exc:  # unresolvable, or no route: the push could never reach it
                raise SyncError("start", server.target, f"no route to {host}: {exc}") from None
            if address not in served:
                served[address] = WeightFiles(address)
            self.files[server.target] = served[address]

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = list(named_tensors)
        path = write_weights(tensors, self.weights_dir)
        size = path.stat().st_size
        committed, failed = [], {}
        token = secrets.token_urlsafe(24)
        try:
            for server in self.transports:
                source = self.files[server.target].offer(token, path)
                try:
                    self._load(server.target, source, version, len(tensors))
                    committed.append(server.target)
                except (httpx.HTTPError, ValueError) as exc:
                    failed[server.target] = str(exc).splitlines()[0]
        finally:
            for files in self.files.values():
                files.withdraw(token)
            path.unlink(missing_ok=True)  # every server has read it, or failed to
        if not committed:
            target, why = next(iter(failed.items()))
            raise SyncError("load", target, why)
        seconds = time.perf_counter() - start
        return SyncStats(
            version, seconds, size * len(committed), committed=committed, failed=failed
        )

    def _load(self, url: str, source: str, version: int, count: int) -> None:
        self._post(f"{url}/pause", params={"mode": "wait"})
        try:
            args = [source, str(version), sign(self.key, source, version)]
            body = {"method": LOAD_METHOD, "args": args}
            answer = self._post(f"{url}/collective_rpc", json={**body, "timeout": self.timeout_s})
            results = answer.get("results") or []
            refused = [r[1] for r in results if isinstance(r, list) and r[:1] == ["refused"]]
            if refused:
                raise ValueError(f"{url}: {refused[0]}")
            if not results or any(r != [version, count] for r in results):
                raise ValueError(
                    f"{url}: workers answered {results}, expected [{version}, {count}] each"
                )
            self._post(f"{url}/reset_prefix_cache")
        finally:
            self._post(f"{url}/resume")

    def seedless(self) -> list[str]:
        """The servers that cannot take per-request seeds (vLLM's CPU build), or did not say."""
        out = []
        for server in self.transports:
            body = {"method": "rlpost_serves_seeds", "timeout": self.timeout_s}
            try:
                answer = self._post(f"{server.target}/collective_rpc", json=body)
            except (httpx.HTTPError, ValueError):  # down, or no dev routes: the push will say
                answer = {}
            if not answer.get("results") or any(r != [True] for r in answer["results"]):
                out.append(server.target)
        return out

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
        for files in {id(f): f for f in self.files.values()}.values():
            files.close()


def build_sync(cfg) -> VLLMServerSync:
    """The weight push of ``rollout.engine.server=vllm`` (servers, admin key, sync timeout)."""
    from rlpost.rollout.engines.client import keys_from_env

    e = cfg.rollout.engine
    admin = keys_from_env(e.api_key_env, e.admin_key_env)["admin_key"]
    if not admin:
        raise ConfigError(
            f"rollout.engine.admin_key_env={e.admin_key_env}: that variable is empty, and "
            f"rollout.engine.server=vllm signs each push with it; set it, and start each "
            f"vllm serve with {KEY_ENV} (the same key) and {FROM_ENV} (this machine's address)"
        )
    return VLLMServerSync(
        list(e.servers), key=admin, timeout_s=cfg.sync.timeout_s,
        headers={"Authorization": f"Bearer {admin}"},
    )  # fmt: skip
