"""Start ``rlpost serve`` on 127.0.0.1 for a benchmark: one helper the benches share."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(
    model_dir: Path | None, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``rlpost serve --port 0 [--model DIR] FLAGS`` on a free loopback port; (process, URL).

    Waits for ``/health`` (up to a minute) and exits the benchmark in one line otherwise.
    ``env`` adds variables (e.g. the server's keys) to this process's environment.
    """
    cmd = [sys.executable, "-m", "rlpost.rollout.serve.server", "--port", "0"]
    cmd += ["--model", str(model_dir)] if model_dir else []
    proc = subprocess.Popen(
        [*cmd, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"rlpost serve did not start: {line!r}")
    url = line.split("listening on ")[1].split()[0]
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("rlpost serve never became healthy")
