"""Rendezvous sockets bound to one address (CPU, loopback): the TCPStore server listens on
the host it is given only, and the gloo interface follows the route to the rendezvous."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from rlpost.sync.listen import (
    interface_of,
    is_loopback,
    local_address_towards,
    pin_interface,
    tcp_store,
)
from tests import netns


def test_the_store_server_listens_on_its_host_only_and_serves_clients():
    server = tcp_store("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    client = tcp_store("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    mine = [x for x in netns.listeners() if x.port == server.port and x.pid == os.getpid()]
    assert [x.ip for x in mine] == ["127.0.0.1"]  # not 0.0.0.0 nor ::, as TCPStore binds
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_a_port_in_use_is_an_error_not_a_second_listener():
    server = tcp_store("127.0.0.1", 0, 1, True, timedelta(seconds=5))
    with pytest.raises(OSError):
        tcp_store("127.0.0.1", server.port, 1, True, timedelta(seconds=5))


def test_loopback_hosts_and_the_route_to_them():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.200.0.2") and not is_loopback("no-such-host.invalid")
    assert local_address_towards("127.0.0.1") == "127.0.0.1"


def test_the_gloo_interface_is_the_one_reaching_the_host_unless_one_is_named(monkeypatch):
    loop = interface_of("127.0.0.1")
    assert loop is not None and interface_of("192.0.2.77") is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    pin_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loop
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    pin_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"  # the operator's choice is kept
