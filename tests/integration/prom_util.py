"""Start Debian's Prometheus server on loopback, point it at targets, query it back.

Shared by the scrape tests: the recorder endpoint test here and any test that
scrapes a real training run. Every wait is bounded and the server is always
killed, also when the test fails.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "needs Debian's prometheus package (apt-get install -y prometheus)"


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(
    path: Path, targets: list[str], *, job: str = "rlpost", scrape_interval: str = "1s"
) -> Path:
    """Write a Prometheus config scraping ``targets`` ("host:port") as ``job``."""
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML
    return path


def _get_json(url: str, timeout: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/-/ready", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running_prometheus(config: Path, workdir: Path, *, timeout: float = 30.0) -> Iterator[str]:
    """Run ``prometheus`` with ``config`` until the block exits; yields its base URL."""
    if PROMETHEUS is None:
        raise RuntimeError(NO_PROMETHEUS)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = workdir / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout
            while not _ready(base_url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text()[-2000:]
                    raise RuntimeError(f"prometheus did not become ready on {base_url}:\n{tail}")
                time.sleep(0.2)
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def query(base_url: str, expr: str) -> list[dict[str, Any]]:
    """Instant query through ``/api/v1/query``; the result vector (may be empty)."""
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = _get_json(url)
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {body}")
    return body["data"]["result"]


def wait_for(
    base_url: str,
    expr: str,
    accept: Callable[[list[dict[str, Any]]], bool],
    *,
    timeout: float = 30.0,
) -> list[dict[str, Any]]:
    """Poll ``expr`` until ``accept(result)``; raise with the last result after ``timeout``."""
    deadline = time.monotonic() + timeout
    result: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        result = query(base_url, expr)
        if accept(result):
            return result
        time.sleep(0.5)
    raise TimeoutError(f"{expr!r} not accepted within {timeout:g}s; last result: {result}")


def value_of(result: list[dict[str, Any]]) -> float | None:
    """The value of a one-element instant vector, else None."""
    return float(result[0]["value"][1]) if len(result) == 1 else None
