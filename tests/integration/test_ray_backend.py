"""The Ray backend (CPU): its cases run on a real local Ray cluster inside a network
namespace that has only loopback, so no Ray traffic can leave the machine.

``ray_cases.py`` holds the cases (a rollout actor SIGKILLed mid-run, placement that
cannot be satisfied, every Ray process listening on loopback only); this module
starts them under ``unshare -n`` and asserts every one of them passed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.cluster import starter
from rlpost.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ray_cases_in_a_loopback_only_network_namespace():
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip to make a loopback-only network namespace")
    pytest.importorskip("ray", reason='the Ray backend needs pip install -e ".[ray]"')
    inner = (
        f"ip link set lo up && {shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider "
        "tests/integration/ray_cases.py"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", inner],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    # Ray's daemons log into the captured output; keep pytest's own lines for the report
    noise = re.compile(r"\(raylet\)|\[state-dump\]|\(gcs_server\)|network_util\.cc")
    kept = [x for x in (done.stdout + done.stderr).splitlines() if not noise.search(x)]
    tail = "\n".join(kept)[-6000:]
    assert done.returncode == 0, tail
    summary = re.search(r"(\d+) passed", done.stdout)
    assert summary and int(summary.group(1)) >= 4, tail
    assert not re.search(r"\d+ (failed|skipped|error)", done.stdout), tail


def test_ray_backend_without_ray_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "cluster.backend=ray"])
    with pytest.raises(ConfigError) as err:
        starter(cfg)
    message = str(err.value)
    assert 'pip install -e ".[ray]"' in message
    assert "\n" not in message


def test_worker_counts_other_backends_cannot_honour_are_one_line(tmp_path):
    from rlpost.pipeline import rules

    for extra in (
        ["cluster.backend=local", "cluster.rollout_workers=2"],
        ["cluster.backend=process", "cluster.reward_workers=1"],
    ):
        cfg = load_config(None, [f"run.output_dir={tmp_path}", *extra])
        with pytest.raises(ConfigError) as err:
            rules.check(cfg)
        assert "\n" not in str(err.value) and "cluster." in str(err.value)
