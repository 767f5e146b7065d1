"""What rlpost's own entry points listen on; run by test_listeners.py inside a network
namespace whose hostname and default route give the machine the address 10.200.0.2, so
anything bound to "the machine's address" or to every address shows off loopback."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
from http.server import ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch

from rlpost.config import SyncConfig, load_config
from rlpost.sync import build_weight_sync
from rlpost.sync.gloo import GlooLink, serve_gloo
from rlpost.sync.listen import local_address_towards
from tests import netns
from tests.conftest import small_overrides
from tests.unit.sync.engines import DictEngine, toy_weights

pytestmark = pytest.mark.skipif(
    socket.gethostbyname(socket.gethostname()) != netns.ADDRESS,
    reason="runs inside the namespace test_listeners.py makes",
)


def _assert_loopback_only(found, want_some: int = 1) -> None:
    off = [str(x) for x in found if not x.loopback]
    assert not off, "listening off loopback: " + "; ".join(off)
    assert len(found) >= want_some, [str(x) for x in found]


def test_the_namespace_gives_the_machine_a_routable_address_and_sees_a_wildcard_bind():
    assert local_address_towards("192.0.2.1") == netns.ADDRESS  # the default route's source
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert [x.port for x in netns.off_loopback({os.getpid()})] == [port]


def test_a_short_ray_run_listens_on_loopback_only_and_its_cluster_wants_a_token(tmp_path):
    """cluster.backend=ray with two data-parallel trainers (TCPStore, gloo pairs), a rollout
    actor and the Prometheus exporter: every socket of every process is on loopback."""
    ray = pytest.importorskip("ray")
    from rlpost.cluster.ray_backend import start_ray_workers
    from rlpost.pipeline.loop import train

    over = {
        "cluster.backend": "ray",
        "cluster.trainer_workers": 2,
        "run.threads": 1,
        "train.steps": 2,
        "eval.every": 0,
        "checkpoint.every": 0,
        "observe.prometheus.port": 0,
    }
    cfg = load_config(None, small_overrides(tmp_path, **over))
    seen: list = []

    def on_groups(step, groups):
        if step == 2:
            seen.append(netns.listeners())
            seen.append(_gcs_answers_without_token(ray))

    result = train(cfg, start=start_ray_workers, on_groups=on_groups)
    assert [h["step"] for h in result.history] == [1, 2]
    found, refused = seen
    names = {x.process for x in found}
    assert {"gcs_server", "raylet"} <= names, sorted(names)
    _assert_loopback_only(found, want_some=8)
    assert refused == "UNAUTHENTICATED"
    assert "RAY_AUTH_TOKEN" not in os.environ  # the run's token left with its cluster


def test_joining_a_cluster_without_token_auth_warns_in_one_line(tmp_path, monkeypatch, caplog):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from rlpost.cluster.ray_connect import connect

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    address = cluster.address
    try:
        cfg = load_config(None, small_overrides(tmp_path, **{"cluster.address": address}))
        with caplog.at_level("WARNING", logger="rlpost.cluster.ray_connect"):
            assert connect(ray, cfg) is False  # joined, not started
        ray.shutdown()
    finally:
        cluster.shutdown()
    lines = [r.getMessage() for r in caplog.records if "token authentication" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"cluster.address={address}" in lines[0] and "RAY_AUTH_MODE=token" in lines[0]


def _gcs_answers_without_token(ray) -> str:
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    address = ray._private.worker.global_worker.node.gcs_address
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def test_rlpost_serve_listens_on_loopback_by_default(tiny_dir):
    from tests.integration.test_server import start_server, stop_server

    proc, url = start_server(tiny_dir)
    try:
        found = [x for x in netns.listeners() if x.pid == proc.pid]
    finally:
        stop_server(proc)
    assert url.startswith("http://127.0.0.1:")
    _assert_loopback_only(found)


def _receive(link: GlooLink) -> None:
    torch.set_num_threads(1)
    engine = DictEngine({k: torch.zeros_like(v) for k, v in toy_weights().items()})
    serve_gloo(engine, link, 1, timeout_s=60)


def test_the_gloo_sync_channel_listens_on_loopback_only():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    link = GlooLink("127.0.0.1", port, world_size=2)
    proc = mp.get_context("spawn").Process(target=_receive, args=(link,))
    proc.start()
    sync = build_weight_sync(SyncConfig(channel="gloo", codec="bf16", timeout_s=60), [link])
    try:
        sync.push(toy_weights(0).items(), 1)
        found = [x for x in netns.listeners() if x.pid in (os.getpid(), proc.pid)]
    finally:
        sync.close()
        proc.join(60)
    assert proc.exitcode == 0
    _assert_loopback_only(found, want_some=3)  # the store and a pair on each side


def test_the_weight_pull_server_listens_during_a_push_only_facing_the_server(tmp_path):
    """``rollout.engine.server=vllm`` with a server off this machine: the trainer offers the
    weight file on its address facing that server while the push lasts, and nowhere else."""
    from rlpost.rollout.engines.vllm_server import VLLMServerSync
    from rlpost.rollout.engines.vllm_worker import FROM_ENV, KEY_ENV
    from tests.unit.rollout.test_vllm_server import KEY, _DevRoutes

    during: list = []

    class Watched(_DevRoutes):
        env: ClassVar[dict] = {KEY_ENV: KEY, FROM_ENV: netns.ADDRESS}  # the trainer's, facing it
        model: ClassVar[dict] = {n: tuple(t.shape) for n, t in toy_weights(0).items()}

        def do_POST(self):
            if self.path.startswith("/collective_rpc"):
                during.extend(x for x in netns.listeners() if x.pid == os.getpid())
            super().do_POST()

    server = ThreadingHTTPServer((netns.ADDRESS, 0), Watched)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://{netns.ADDRESS}:{server.server_address[1]}"
    own = f"{netns.ADDRESS}:{server.server_address[1]}"
    sync = VLLMServerSync([url], key=KEY)
    try:
        idle = [x for x in netns.listeners() if x.pid == os.getpid()]
        sync.push(toy_weights(0).items(), 1)
        after = [x for x in netns.listeners() if x.pid == os.getpid()]
    finally:
        sync.close()
        server.shutdown()
        server.server_close()
    assert [f"{x.ip}:{x.port}" for x in idle] == [own] == [f"{x.ip}:{x.port}" for x in after]
    pulls = [x for x in during if f"{x.ip}:{x.port}" != own]
    assert len(pulls) == 1 and pulls[0].ip == netns.ADDRESS, [str(x) for x in during]
