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
        "ip daddr 10.0.0.2 fib daddr . iif type local accept",
        "tcp dport { 22, 9100-9101 } accept",
        "tcp flags & (syn | ack) == syn drop",
    ]
    six = _run("fd00::2", "--allow", "", "--print").stdout
    assert "ip6 daddr fd00::2 fib daddr . iif type local accept" in six and "dport" not in six


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


NEEDS_NFT = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(x) for x in ("nft", "unshare", "ip")),
    reason="loading a table needs root, nft (apt-get install nftables), unshare and ip",
)


@NEEDS_NFT
def test_the_table_loads_and_a_second_run_replaces_it():
    script = shlex.quote(str(SCRIPT))
    steps = f"bash {script} 10.0.0.2 && bash {script} 10.0.0.9 --allow '' && nft list ruleset"
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", steps], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("table inet rlpost_cluster") == 1
    assert "ip daddr 10.0.0.9 fib daddr . iif type local accept" in done.stdout
    assert "10.0.0.2" not in done.stdout
    assert "dport" not in done.stdout


# The node (this namespace) is on two networks: eth0 holds the cluster address 10.201.0.1
# (a peer at .2), eth1 10.202.0.1 (the outsider at .4). The outsider routes the cluster
# address through eth1, and the node filters reverse paths strictly (rp_filter=1).
# probe FROM ADDRESS prints 1 when a TCP connection from that namespace is accepted.
TWO_NETWORKS = """set -e
mkdir -p /run/netns; mount -t tmpfs rlpost-netns /run/netns; ip link set lo up
echo 1 > /proc/sys/net/ipv4/conf/all/rp_filter
for n in peer out; do ip netns add $n; ip -n $n link set lo up; done
ip link add eth0 type veth peer name eth0 netns peer
ip link add eth1 type veth peer name eth0 netns out
ip addr add 10.201.0.1/24 dev eth0; ip link set eth0 up
ip addr add 10.202.0.1/24 dev eth1; ip link set eth1 up
ip -n peer addr add 10.201.0.2/24 dev eth0; ip -n peer link set eth0 up
ip -n out addr add 10.202.0.4/24 dev eth0; ip -n out link set eth0 up
ip -n out route add 10.201.0.1/32 via 10.202.0.1
python3 -c 'import socket, time; s = socket.create_server(("", 7000)); time.sleep(60)' &
sleep 1
probe() {
  ip netns exec "$1" python3 -c 'import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    print(int(s.connect_ex((sys.argv[1], 7000)) == 0))' "$2"
}
report() {
  echo "$1 peer $(probe peer 10.201.0.1) out $(probe out 10.201.0.1) out-other $(probe out 10.202.0.1)"
}
report none
bash {script} 10.201.0.1 --allow ''
report firewall
kill $!
"""


@NEEDS_NFT
def test_the_cluster_address_answers_only_on_its_own_interface():
    """A host on the node's other network that routes the cluster address through the
    node's interface there reaches it without the firewall (Linux's weak host model,
    rp_filter=1 notwithstanding) and not with it; the peer on the cluster network does."""
    steps = TWO_NETWORKS.replace("{script}", shlex.quote(str(SCRIPT)))
    argv = ["unshare", "-n", "-m", "--propagation", "private", "sh", "-c", steps]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "none peer 1 out 1 out-other 1",
        "firewall peer 1 out 0 out-other 0",
    ], done.stdout + done.stderr
