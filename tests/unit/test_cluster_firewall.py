"""deploy/cluster_firewall.sh: its rules, its one-line refusals, and the table it loads
(in a network namespace of the test's own, as root with nft)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "cluster_firewall.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    argv = ["bash", str(SCRIPT), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_the_rules_drop_new_connections_to_other_addresses_only():
    done = _run("10.0.0.2", "--allow", "22,9100-9101", "--print")
    assert done.returncode == 0, done.stderr
    rules = [x.strip() for x in done.stdout.splitlines()]
    chain = rules[rules.index("chain input {") + 1 :]
    # in order: loopback and the cluster address pass, then the allowed ports, then the drop
    assert chain[:5] == [
        "type filter hook input priority filter; policy accept;",
        'iif "lo" accept',
        "ip daddr 10.0.0.2 accept",
        "tcp dport { 22, 9100-9101 } accept",
        "tcp flags & (syn | ack) == syn drop",
    ]
    six = _run("fd00::2", "--allow", "", "--print").stdout
    assert "ip6 daddr fd00::2 accept" in six and "dport" not in six


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "give the node's cluster address"),
        (("10.0.0.300", "--print"), "'10.0.0.300' is not an IP address"),
        (("10.0.0.2", "--allow", "ssh", "--print"), "--allow 'ssh' is not a port list"),
        (("10.0.0.2", "--allow"), "--allow needs a port list"),
        (("10.0.0.2", "10.0.0.3", "--print"), "one cluster address"),
        (("10.0.0.2", "--flush"), "unknown option --flush"),
    ],
)
def test_bad_input_is_refused_in_one_line(args, says):
    done = _run(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("unshare"),
    reason="loading a table needs root, nft (apt-get install nftables) and unshare",
)
def test_the_table_loads_and_a_second_run_replaces_it():
    script = shlex.quote(str(SCRIPT))
    steps = f"bash {script} 10.0.0.2 && bash {script} 10.0.0.9 --allow '' && nft list ruleset"
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", steps], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("table inet rlpost_cluster") == 1
    assert "ip daddr 10.0.0.9 accept" in done.stdout and "10.0.0.2" not in done.stdout
    assert "dport" not in done.stdout
