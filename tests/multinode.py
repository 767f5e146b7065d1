"""Simulated hosts for multi-node tests and benches: network namespaces on a private bridge.

A :class:`Bed` of N hosts is N network namespaces (``ip netns``), each with one veth
interface on a Linux bridge, host ``i`` at ``10.201.0.i/24`` (and, given
:meth:`Bed.add_network`, a second interface on a second bridge). The bridge and the
namespaces' names live inside the caller's own network and mount namespaces, so the
caller must run isolated (:func:`isolated`, ``unshare -n -m``): no interface, route or
``/run/netns`` entry of the machine is touched, and when the caller ends nothing is
left. The hosts share the filesystem, which serves as the shared run directory the docs
require of a real cluster. Ray on the bed runs as on real machines: a head on host 1
(``ray start --head``), the other hosts joining with ``ray start --address``, every node
with token authentication and its own temp dir, its own custom resources (the labels a
placement names), and Ray's ports pinned so that a listener can be told apart from
rlpost's own.

Faults: :meth:`Bed.kill_host` kills every process in a host's namespace (a lost machine),
:meth:`Bed.partition` drops its link for a while. :meth:`Bed.received` counts the bytes
a host's link delivered to it (what crossed the bridge).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests import netns

SUBNET = "10.201.0"
PORT = 6379
# Ray's own listeners, pinned per node (the rest are ephemeral ports 32768-60999):
# node manager, object manager, metrics export, dashboard agent grpc/http, runtime env
# agent, Ray client (head), then the worker processes' gRPC ports
RAY_PORTS = {
    "node_manager": 7001,
    "object_manager": 7002,
    "metrics_export": 7003,
    "dashboard_agent_grpc": 7004,
    "dashboard_agent_listen": 7005,
    "runtime_env_agent": 7006,
    "ray_client_server": 7007,
}
WORKER_PORTS = (11000, 11999)
OBJECT_STORE_BYTES = 200 * 1024 * 1024
# the head declares a silent node dead after 3 missed 1 s health checks (Ray's default:
# 5 missed 3 s checks), so a lost host's work moves within seconds
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or None."""
    return netns.unavailable()


def isolated(argv: list[str]) -> list[str]:
    """``argv`` inside fresh network and mount namespaces (where a :class:`Bed` may be made)."""
    return ["unshare", "-n", "-m", "--propagation", "private", *argv]


def is_isolated() -> bool:
    """Whether this process runs in a network namespace of its own: one whose interfaces
    are loopback and a bed's bridge and links only (the machine's are not there)."""
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    names = {x.split(":")[0].strip() for x in lines}
    return all(n == "lo" or n.startswith(("rlbr", "rlv")) for n in names)


def ray_ports() -> set[int]:
    """Every port Ray listens on in the bed (besides ephemeral ones it may also open)."""
    return {PORT, *RAY_PORTS.values(), *range(WORKER_PORTS[0], WORKER_PORTS[1] + 1)}


class Bed:
    """N simulated hosts; ``with Bed(3) as bed:`` makes them and removes them (and every
    process in them) at the end. Host numbers start at 1."""

    def __init__(self, hosts: int, *, cpus: int = 4, root: Path | None = None) -> None:
        if not is_isolated():
            raise RuntimeError(
                "a Bed must be made inside its own namespaces (tests.multinode.isolated)"
            )
        self.n, self.cpus = hosts, cpus
        # Ray's unix sockets live under the temp dir: keep its path short
        root = root or os.environ.get("RLPOST_BED_DIR")
        self.root = Path(tempfile.mkdtemp(prefix="bed", dir=root or "/tmp"))
        self.token = secrets.token_hex(32)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.up = False
        self.runs: list[TrainRun] = []  # started on this bed
        self.custom: set[str] = set()  # the custom resources its nodes were given

    # ------------------------------------------------------------ network

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i}"

    @property
    def head(self) -> str:
        return f"{self.address(1)}:{PORT}"

    def __enter__(self) -> Bed:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        # /run/netns holds the namespaces' names: a tmpfs of this mount namespace only
        os.makedirs("/run/netns", exist_ok=True)
        _sh("mount -t tmpfs rlpost-netns /run/netns")
        _sh(
            "ip link set lo up; ip link add rlbr0 type bridge; ip link set rlbr0 up; "
            "ip link add rlbr1 type bridge; ip link set rlbr1 up"
        )
        self.up = True
        for i in range(1, self.n + 1):
            self.add_host(i)

    def add_host(self, i: int) -> None:
        """Host ``i``: a namespace with ``lo`` and ``eth0`` (10.201.0.i) on the bridge."""
        _sh(
            f"ip netns add h{i}; ip link add rlv{i} type veth peer name eth0 netns h{i}; "
            f"ip link set rlv{i} master rlbr0 up; "
            f"ip -n h{i} addr add {self.address(i)}/24 dev eth0; "
            f"ip -n h{i} link set eth0 up; ip -n h{i} link set lo up"
        )

    def add_network(self, i: int, cidr: str) -> None:
        """Host ``i`` on a second network: ``eth1`` holding ``cidr``, on a second bridge."""
        _sh(
            f"ip link add rlvo{i} type veth peer name eth1 netns h{i}; "
            f"ip link set rlvo{i} master rlbr1 up; "
            f"ip -n h{i} addr add {cidr} dev eth1; ip -n h{i} link set eth1 up"
        )

    def on(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i``."""
        return ["ip", "netns", "exec", f"h{i}", *argv]

    def run(self, i: int, argv: list[str], *, timeout: float = 120, **kw):
        """Run ``argv`` on host ``i`` to completion (output captured)."""
        return subprocess.run(
            self.on(i, argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.on(i, argv), env=self.env, **kw)

    def pids(self, i: int) -> list[int]:
        """Every process in host ``i``'s namespace."""
        done = subprocess.run(["ip", "netns", "pids", f"h{i}"], capture_output=True, text=True)
        return [int(x) for x in done.stdout.split()]

    def processes(self, i: int) -> list[str]:
        """The command lines of host ``i``'s processes (Ray names actors ``ray::Class``)."""
        out = []
        for pid in self.pids(i):
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            out.append(raw.replace(b"\0", b" ").decode(errors="replace").strip())
        return out

    def listeners(self, i: int) -> list[netns.Listener]:
        """Host ``i``'s listening sockets (read through one of its processes)."""
        for pid in self.pids(i):
            try:
                return netns.listeners(pid)
            except OSError:
                continue
        return []

    def received(self, i: int) -> int:
        """Bytes the bridge delivered to host ``i`` so far."""
        # the bridge's end of host i's link transmits what host i receives; /sys shows the
        # machine's interfaces, /proc/self/net/dev this namespace's
        for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
            name, counters = line.split(":", 1)
            if name.strip() == f"rlv{i}":
                return int(counters.split()[8])
        raise KeyError(f"no link rlv{i}")

    def reachable(self, i: int, address: str, ports, timeout: float = 2.0) -> set[int]:
        """The ``ports`` of ``address`` that accept a TCP connection from host ``i``, all
        tried at once (a dropped SYN costs ``timeout`` once, not once a port)."""
        probe = (
            "import socket, sys\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            "def ok(port):\n"
            "    with socket.socket() as s:\n"
            "        s.settimeout(float(sys.argv[2]))\n"
            "        return s.connect_ex((sys.argv[1], port)) == 0\n"
            "ports = [int(x) for x in sys.argv[3:]]\n"
            "with ThreadPoolExecutor(64) as pool:\n"
            "    print(' '.join(str(p) for p, y in zip(ports, pool.map(ok, ports)) if y))\n"
        )
        ports = sorted(set(ports))
        if not ports:
            return set()
        argv = [sys.executable, "-c", probe, address, str(timeout), *map(str, ports)]
        done = self.run(i, argv)
        if done.returncode != 0:
            raise RuntimeError(f"probe from host {i} failed: {done.stderr[-1000:]}")
        return {int(x) for x in done.stdout.split()}

    # ------------------------------------------------------------ faults

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process on host ``i`` (the machine is lost); their pids."""
        killed = []
        for _ in range(20):  # a dying raylet may still fork: repeat until none is left
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    continue
            time.sleep(0.2)
        return sorted(set(killed))

    def partition(self, i: int) -> None:
        """Cut host ``i`` off the bridge (its processes live on, unreachable)."""
        _sh(f"ip link set rlv{i} down")

    def heal(self, i: int) -> None:
        _sh(f"ip link set rlv{i} up")

    # ------------------------------------------------------------ Ray

    def start_ray(self, resources: dict[int, dict[str, float]]) -> None:
        """A Ray head on host 1 and the other hosts of ``resources`` joined to it;
        ``resources``: host -> its custom resources (what a placement names)."""
        for i in sorted(resources):  # the head first
            self.start_node(i, resources[i])

    def start_node(self, i: int, resources: dict[str, float], shift: int = 0) -> None:
        """Ray on host ``i``: the head for host 1, else a node joining it; ``shift``: its
        raylet and object manager on ports that many above the pinned ones."""
        self.custom.update(resources)
        ports = {**RAY_PORTS}
        for k in ("node_manager", "object_manager"):
            ports[k] += shift
        ports = [f"--{k.replace('_', '-')}-port={v}" for k, v in ports.items()]
        if i != 1:
            ports = [p for p in ports if "ray-client-server" not in p]
        argv = [
            "ray",
            "start",
            f"--node-ip-address={self.address(i)}",
            f"--num-cpus={self.cpus}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--resources={json.dumps(resources)}",
            f"--temp-dir={self.root / f'h{i}'}",
            f"--min-worker-port={WORKER_PORTS[0]}",
            f"--max-worker-port={WORKER_PORTS[1]}",
            "--disable-usage-stats",
            *ports,
        ]
        if i == 1:
            argv += ["--head", f"--port={PORT}", "--include-dashboard=false"]
            argv += [f"--system-config={json.dumps(HEALTH_CHECK)}"]
        else:
            argv += [f"--address={self.head}"]
        done = self.run(i, argv, timeout=180)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"ray start on host {i} failed:\n{tail}")

    def python(self, i: int, code: str, timeout: float = 120) -> str:
        """Run Python ``code`` on host ``i`` (with the cluster's token); its stdout."""
        done = self.run(i, [sys.executable, "-c", code], timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"on host {i}: {done.stderr[-2000:]}")
        return done.stdout

    def ask_ray(self, expr: str, i: int = 1):
        """The value of ``expr`` (JSON-able, may use ``ray``) read from the cluster by a
        driver on host ``i``; its answer picked out of whatever else Ray prints."""
        mark = "RLPOST-ANSWER "
        code = (
            "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
            f"print({mark!r} + json.dumps({expr}), flush=True)"
        )
        out = self.python(i, code)
        for line in reversed(out.splitlines()):
            if line.startswith(mark):
                return json.loads(line[len(mark) :])
        raise RuntimeError(f"no answer from host {i}: {out[-1000:]}")

    def settle(self, timeout: float = 90) -> None:
        """Stop every run still going, then wait until the cluster has every custom resource
        of its live nodes free again (a dead driver's actors and bundles released)."""
        for run in self.runs:
            run.stop()
        self.runs.clear()
        expr = "[ray.available_resources(), ray.cluster_resources()]"
        deadline = time.monotonic() + timeout
        while True:
            free, total = self.ask_ray(expr)
            held = {
                k: (free.get(k, 0), v)
                for k, v in total.items()
                if k in self.custom and free.get(k, 0) < v
            }
            if not held:
                return
            assert time.monotonic() < deadline, (
                f"resources still held after {timeout:.0f} s: {held}"
            )
            time.sleep(1)

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill every process of every host, then remove the hosts and the bridge."""
        if not self.up:
            return
        for i in range(1, self.n + 1):
            if Path(f"/run/netns/h{i}").exists():
                self.kill_host(i)
                subprocess.run(["ip", "netns", "del", f"h{i}"], capture_output=True)
        for bridge in ("rlbr0", "rlbr1"):
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        subprocess.run(["umount", "/run/netns"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        self.up = False


def _sh(command: str) -> None:
    done = subprocess.run(["sh", "-c", "set -e; " + command], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command}: {done.stderr.strip()}")


def _lines(path: Path) -> list[str]:
    """The complete lines of a JSON-lines file another process is appending to."""
    text = path.read_text()
    return [x for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]


class TrainRun:
    """``rlpost train`` on a host of the bed (overrides ``base``, then ``extra``), joined to
    the bed's cluster; ``wait(on_step)`` calls ``on_step(step)`` as each step's metrics row
    appears, while the run goes on. ``resume``: continue the run of that name from its
    last checkpoint (``--resume``)."""

    def __init__(
        self, bed, out: Path, name: str, base: dict, host: int = 1, resume: bool = False, **extra
    ) -> None:
        self.dir = out / name
        over = {**base, "run.output_dir": str(out), "run.name": name, **extra}
        over["cluster.address"] = bed.head
        argv = [sys.executable, "-m", "rlpost.cli", "train"] + [f"{k}={v}" for k, v in over.items()]
        if resume:
            argv += ["--resume", str(self.dir)]
        self.log = out / f"{name}{'.resumed' if resume else ''}.log"
        self.proc = bed.popen(host, argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        bed.runs.append(self)

    def stop(self) -> None:
        """Kill the run if it still goes (a failed case must not hold the cluster)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait(self, on_step: Callable[[int], None] | None = None, timeout: float = 900) -> int:
        deadline, seen = time.monotonic() + timeout, 0
        try:
            while self.proc.poll() is None:
                assert time.monotonic() < deadline, self.tail()
                for step in [r["step"] for r in self.rows() if r["step"] > seen]:
                    seen = step
                    if on_step is not None:
                        on_step(step)
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self.proc.returncode

    def rows(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(x) for x in _lines(path)]
        return [r for r in rows if r["step"] > 0 and "loss" in r]

    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def events(self) -> list[dict]:
        path = self.dir / "cluster_events.jsonl"
        return [json.loads(x) for x in _lines(path)] if path.exists() else []

    def tail(self) -> str:
        return self.log.read_text()[-4000:]
