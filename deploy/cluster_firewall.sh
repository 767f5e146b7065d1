#!/usr/bin/env bash
# Keep a cluster node's listeners to its cluster address. Ray's own servers (GCS, raylet,
# object manager, workers, agents) listen on every address of a node whose node address
# is not loopback; its token refuses callers without it, and this rule keeps them off the
# node's other networks altogether: a new TCP connection to any address of this node
# other than the cluster address and loopback is dropped, unless its port is in --allow.
# The cluster address counts only on the interface that holds it: Linux accepts a packet
# for any local address on any interface (the weak host model, which rp_filter does not
# change), so a host on another network that routes the cluster address through this
# node's interface there would otherwise pass. Connections the node opens itself, and
# their replies, are untouched. One nftables table, `inet rlpost_cluster`, replaced as a
# whole on each run.
#
#   bash deploy/cluster_firewall.sh CLUSTER_ADDRESS [--allow PORTS] [--print | --remove]
#
#   --allow 22,8000-8010   ports that stay open on every address (default: 22, ssh)
#   --print                print the ruleset instead of loading it
#   --remove               delete the table
set -euo pipefail

die() {
  echo "cluster_firewall: $*" >&2
  exit 2
}

address="" allow="22" mode="load"
while [ $# -gt 0 ]; do
  case "$1" in
    --allow) [ $# -ge 2 ] || die "--allow needs a port list (e.g. 22,8000-8010)"; allow="$2"; shift 2 ;;
    --print) mode="print"; shift ;;
    --remove) mode="remove"; shift ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (options: --allow PORTS, --print, --remove)" ;;
    *) [ -z "$address" ] || die "one cluster address, not '$address' and '$1'"; address="$1"; shift ;;
  esac
done

if [ "$mode" != "print" ] && ! command -v nft >/dev/null; then
  die "nft not found (apt-get install nftables)"
fi
if [ "$mode" = "remove" ]; then
  nft delete table inet rlpost_cluster 2>/dev/null || true
  exit 0
fi

[ -n "$address" ] || die "give the node's cluster address (the one Ray's --node-ip-address names)"
family=$(python3 -c 'import ipaddress, sys
try:
    print("ip" if ipaddress.ip_address(sys.argv[1]).version == 4 else "ip6")
except ValueError:
    pass' "$address")
[ -n "$family" ] || die "'$address' is not an IP address"
ports_re='^[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*$'
[ -z "$allow" ] || [[ "$allow" =~ $ports_re ]] || die "--allow '$allow' is not a port list (e.g. 22,8000-8010)"

keep=""
[ -z "$allow" ] || keep="    tcp dport { ${allow//,/, } } accept"
ruleset="table inet rlpost_cluster
delete table inet rlpost_cluster
table inet rlpost_cluster {
  chain input {
    type filter hook input priority filter; policy accept;
    iif \"lo\" accept
    $family daddr $address fib daddr . iif type local accept
$keep
    tcp flags & (syn | ack) == syn drop
  }
}"

if [ "$mode" = "print" ]; then
  echo "$ruleset"
else
  echo "$ruleset" | nft -f - || die "nft refused the ruleset (run with --print to see it)"
fi
