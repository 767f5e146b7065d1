"""A Ray cluster of several simulated hosts (``tests/multinode.py``): ``multinode_cases.py``
(the fleet and its failures) and ``launch_cases.py`` (the SLURM template's commands) each
run inside network and mount namespaces of their own, where they make the hosts, their
bridge and the cluster; this module starts them, asserts every case passed, and that
nothing they started outlived them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import multinode

ROOT = Path(__file__).resolve().parents[2]
NOISE = re.compile(r"\(raylet\)|\[state-dump\]|\(gcs_server\)|network_util\.cc|socket\.cpp")


def _left_behind(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (the bed's directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and proc.name != str(os.getpid()):
                found.append(f"{proc.name}: {cmd[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cases", "at_least"),
    [("multinode_cases.py", 4), ("launch_cases.py", 1)],
    ids=["fleet", "launch"],
)
def test_multinode_cases_on_simulated_hosts(tmp_path, cases, at_least):
    why = multinode.unavailable()
    if why:
        pytest.skip(why)
    pytest.importorskip("ray", reason='the Ray backend needs pip install -e ".[ray]"')
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    bed_dir = tempfile.mkdtemp(prefix="rlmn", dir="/tmp")  # short: Ray's sockets live there
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLPOST_BED_DIR": bed_dir}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += [f"--basetemp={tmp_path / 'inner'}", f"tests/integration/{cases}"]
    only = os.environ.get("RLPOST_MULTINODE_K")  # a -k expression: some cases only
    if only:
        argv += ["-k", only, "-s"]
    try:
        done = subprocess.run(
            multinode.isolated(argv),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=2400,
        )
        left = _left_behind(bed_dir)
    finally:
        shutil.rmtree(bed_dir, ignore_errors=True)
    kept = [x for x in (done.stdout + done.stderr).splitlines() if not NOISE.search(x)]
    tail = "\n".join(kept)[-6000:]
    assert done.returncode == 0, tail
    summary = re.search(r"(\d+) passed", done.stdout)
    assert summary and (only or int(summary.group(1)) >= at_least), tail
    print("\n".join(x[x.index("measured:") :] for x in kept if "measured:" in x))
    assert not re.search(r"\d+ (failed|skipped|error)", done.stdout), tail
    assert not left, left
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout == links
