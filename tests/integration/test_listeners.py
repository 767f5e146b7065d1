"""Nothing rlpost starts listens beyond loopback unless asked: ``listener_cases.py`` runs a
short Ray run (data-parallel trainers, the Prometheus exporter), ``rlpost serve``, the
gloo sync channel and a weight push to a ``vllm serve`` off the machine inside a network
namespace where the machine has the routable address 10.200.0.2 (its hostname resolves to
it, the default route leaves from it), and lists every listening socket there."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests import netns

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_listener_is_on_loopback_in_a_namespace_with_a_routable_address(tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    inner = (
        f"{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider "
        f"--basetemp={shlex.quote(str(tmp_path / 'inner'))} tests/integration/listener_cases.py"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    done = netns.run_inside(inner, tmp_path, env=env, cwd=ROOT, timeout=900)
    noise = re.compile(r"\(raylet\)|\[state-dump\]|\(gcs_server\)|network_util\.cc|socket\.cpp")
    kept = [x for x in (done.stdout + done.stderr).splitlines() if not noise.search(x)]
    tail = "\n".join(kept)[-6000:]
    assert done.returncode == 0, tail
    summary = re.search(r"(\d+) passed", done.stdout)
    assert summary and int(summary.group(1)) == 6, tail
    assert not re.search(r"\d+ (failed|skipped|error)", done.stdout), tail
