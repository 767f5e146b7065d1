"""A network namespace where "the machine's address" is not 127.0.0.1, and its listeners.

:func:`run_inside` runs a command in fresh network, mount and UTS namespaces
(root, ``unshare``): ``lo`` is up, a veth interface holds 10.200.0.2/24 with a
default route through 10.200.0.1, and the hostname resolves to 10.200.0.2 (an
``/etc/hosts`` bind-mounted for the namespace only), as on a machine on a LAN.
Whatever binds "the machine's address" or every address is then visible off
loopback. No packet is sent to the 10.x address; nothing answers there.

:func:`listeners` reads the namespace's sockets from ``/proc/net`` (TCP in LISTEN,
UDP bound and unconnected), with the process holding each; given a pid, those of that
process's namespace (``tests/multinode.py`` lists each simulated host's this way).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ADDRESS = "10.200.0.2"
HOSTNAME = "rlpost-netns"
SETUP = (
    "set -e; mount --bind {hosts} /etc/hosts; hostname {name}; ip link set lo up; "
    "ip link add rl0 type veth peer name rl1; ip addr add {addr}/24 dev rl0; "
    "ip link set rl1 up; ip link set rl0 up; ip route add default via 10.200.0.1; "
)


def unavailable() -> str | None:
    """Why the namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to make a network namespace"
    for tool in ("unshare", "ip", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"needs {tool} to make a network namespace"
    return None


def run_inside(command: str, tmp: Path, *, env: dict, cwd: Path, timeout: float):
    """``sh -c command`` inside the namespace; the completed process."""
    hosts = tmp / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{ADDRESS} {HOSTNAME}\n")
    setup = SETUP.format(hosts=hosts, name=HOSTNAME, addr=ADDRESS)
    return subprocess.run(
        ["unshare", "-n", "-m", "-u", "sh", "-c", setup + command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass(frozen=True)
class Listener:
    proto: str  # tcp, tcp6, udp, udp6
    ip: str
    port: int
    pid: int | None
    process: str

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.ip)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        return f"{self.proto} {self.ip}:{self.port} ({self.process or '?'} pid {self.pid})"


def _ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    # /proc/net prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _owners() -> dict[int, tuple[int, str]]:
    """socket inode -> (pid, process name) for every process this user may read."""
    out: dict[int, tuple[int, str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            name = (proc / "comm").read_text().strip()
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    out[int(target[8:-1])] = (int(proc.name), name)
        except OSError:
            continue  # exited, or not ours to read
    return out


def listeners(pid: int | None = None) -> list[Listener]:
    """Every TCP socket in LISTEN and every bound, unconnected UDP socket here (in the
    network namespace of process ``pid``, when given)."""
    owners = _owners()
    found = []
    net = Path("/proc/net") if pid is None else Path(f"/proc/{pid}/net")
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        path = net / proto
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            local, remote, state, inode = f[1], f[2], f[3], int(f[9])
            if proto.startswith("tcp") and state != "0A":
                continue
            if proto.startswith("udp") and int(remote.split(":")[1], 16) != 0:
                continue  # connected: it receives from its peer only
            host, port = local.split(":")
            pid, name = owners.get(inode, (None, ""))
            found.append(Listener(proto, _ip(host), int(port, 16), pid, name))
    return found


def off_loopback(pids: set[int] | None = None) -> list[Listener]:
    """The listeners not on loopback (of ``pids`` only, when given)."""
    return [x for x in listeners() if not x.loopback and (pids is None or x.pid in pids)]
