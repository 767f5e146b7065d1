"""Which per-run limits one run gets: cgroup controllers, and a seccomp filter for the rest.

Limit by limit, seccomp refuses what a missing cgroup would not bound: memory held outside
address spaces without a memory cgroup, non-unix sockets under v1, ``sched_setaffinity``
without a cpuset; the keyring calls always.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rlpost.rewards.sandbox import cgroup, seccomp
from rlpost.rewards.sandbox.command import SandboxUnavailable
from rlpost.rewards.sandbox.limits import RunLimits

# A run with run_limits="cgroup" refuses to start without these.
REQUIRED_FOR_CGROUP = ("memory", "pids")


@dataclass(frozen=True)
class RunPlan:
    """The cgroup controllers a run is limited by and the calls its filter refuses."""

    mode: RunLimits
    controllers: tuple[cgroup.Controller, ...]
    blocked: tuple[str, ...]
    host: cgroup.CgroupHost

    def controller(self, name: str) -> cgroup.Controller | None:
        return next((c for c in self.controllers if c.name == name), None)

    @functools.cached_property
    def seccomp_program(self) -> bytes | None:
        return seccomp.build_filter(self.blocked) if self.blocked else None


@functools.cache
def plan(mode: RunLimits) -> RunPlan:
    """The limits of a run under ``mode`` on this host; ``SandboxUnavailable`` if they cannot hold."""
    host = cgroup.detect() if mode in ("auto", "cgroup") else cgroup.CgroupHost((), ())
    return make_plan(mode, host, seccomp.supported())


def make_plan(mode: RunLimits, host: cgroup.CgroupHost, seccomp_supported: bool) -> RunPlan:
    """``plan`` for a given host: what ``host`` lacks, the filter refuses."""
    if mode == "none":
        return RunPlan(mode, (), (), host)
    if mode == "cgroup":
        lacking = [name for name in REQUIRED_FOR_CGROUP if host.get(name) is None]
        if lacking:
            reasons = "; ".join(f"{name}: {host.reason(name)}" for name in lacking)
            raise SandboxUnavailable(
                f"sandbox run_limits=cgroup: no usable {', '.join(lacking)} cgroup ({reasons}); "
                "delegate the controllers to this process's cgroup or set run_limits=auto"
            )
    blocked: list[str] = []
    memory = host.get("memory")
    if memory is None:
        blocked += seccomp.SHARED_MEMORY_CALLS + seccomp.KERNEL_MEMORY_CALLS
    elif memory.version == 1:
        blocked += seccomp.NETWORK_SOCKET_CALLS
    if host.get("cpuset") is None:
        blocked += seccomp.AFFINITY_CALLS
    blocked += seccomp.KEYRING_CALLS
    if not seccomp_supported:
        raise SandboxUnavailable(
            f"sandbox run_limits={mode}: no seccomp filter for this machine or kernel, which "
            "every run needs (keyrings; memory and CPU without a cgroup); run on x86_64 or "
            "aarch64 with a kernel built with seccomp"
        )
    return RunPlan(mode, host.usable, tuple(blocked), host)
