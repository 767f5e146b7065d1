"""Joining a Ray cluster, or starting a local one that listens on loopback only.

A joined cluster without token authentication gets one warning line (docs/operations.md,
"Security model").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading

from rlpost.config import Config

log = logging.getLogger(__name__)


def connect(ray, cfg: Config) -> bool:
    """Join ``cluster.address`` or start a loopback-only, token-guarded local cluster; True
    when this call started one."""
    if ray.is_initialized():
        return False
    address = cfg.cluster.address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        with _own_stop_signals():
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        if not _token_auth_on(ray):
            log.warning(
                "cluster.address=%s: this Ray cluster has no token authentication, so whoever "
                "reaches its ports can run code as its user; start it with RAY_AUTH_MODE=token "
                "(Ray >= 2.52, docs/operations.md)",
                address,
            )
        return False
    c = cfg.cluster
    demand = c.trainer_workers * c.trainer.cpus + c.reward_workers * c.reward.cpus
    if c.placement == "split":
        demand += c.rollout_workers * c.rollout.cpus
    LOCAL.enter(ray)
    try:
        # Ray's CPUs are scheduling units: a local cluster gets at least what the roles ask for
        with _own_stop_signals():
            ray.init(
                address="local",  # a new cluster, even where an earlier one left RAY_ADDRESS set
                num_cpus=max(os.cpu_count() or 1, math.ceil(demand)),
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
    except BaseException:
        LOCAL.leave(ray)
        raise
    return True


@contextlib.contextmanager
def _own_stop_signals():
    """Keep this process's SIGINT / SIGTERM handlers over the aborting ones ``ray.init``
    installs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def _token_auth_on(ray) -> bool:
    """Whether the joined cluster refuses a caller without its token: the GCS is asked
    without one (the driver's own setting says nothing about the cluster's)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # no way to ask: an older Ray without token authentication
        return False
    address = ray.get_runtime_context().gcs_address
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=30)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


class _LocalCluster:
    """The environment of a loopback-only, token-guarded local cluster: Ray keeps a loopback
    address only as a single-machine cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``)."""

    ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")

    def __init__(self) -> None:
        self.saved: dict[str, str | None] | None = None
        self.cluster_mode = True

    def enter(self, ray) -> None:
        import secrets

        self.saved = {k: os.environ.get(k) for k in self.ENV}
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled":  # an explicit opt-out
            os.environ["RAY_AUTH_MODE"] = "token"
            if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
                os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # 256 bits, this cluster's
        from ray._private import ray_constants

        self.cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
        self._refresh(ray, cluster=False)

    def leave(self, ray) -> None:
        if self.saved is None:
            return
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.saved = None
        self._refresh(ray, cluster=self.cluster_mode)

    @staticmethod
    def _refresh(ray, *, cluster: bool) -> None:
        """This process read those variables when it imported Ray: have it read them again."""
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = cluster
        try:
            from ray._raylet import AuthenticationTokenLoader, Config
        except ImportError:  # a Ray without token authentication: nothing cached
            return
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


LOCAL = _LocalCluster()
