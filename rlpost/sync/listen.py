"""Rendezvous sockets bound to one address, never to all of them.

``TCPStore`` binds every interface and gloo the hostname's address, both unauthenticated, so
the store's socket is made here on the rendezvous host (``master_listen_fd``) and the gloo
pairs bind the interface that reaches it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (127/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(
        ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos
    )


def local_address_towards(host: str) -> str:
    """The address of this machine that packets to ``host`` leave from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect only picks the route
        return s.getsockname()[0]


def tcp_store(
    host: str, port: int, world_size: int | None, is_master: bool, timeout: timedelta
) -> dist.TCPStore:
    """A ``TCPStore`` whose server (``is_master``) listens on ``host:port`` only."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(info[0], socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
        bound, fd = sock.getsockname()[1], sock.detach()  # the store's server owns it now
    try:
        return dist.TCPStore(host, bound, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):  # the store had closed it already
            os.close(fd)
        raise


def gloo_device(host: str):
    """A gloo device bound to the address this process reaches ``host`` from."""
    return dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))


def gloo_options(host: str, timeout: timedelta):
    """``ProcessGroupGloo`` options whose one device is :func:`gloo_device` (``host``)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [gloo_device(host)]
    return opts


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 ``address`` (Linux), else None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue  # no IPv4 address on this one
        if got == address:
            return name
    return None


def pin_interface(host: str, variable: str = "GLOO_SOCKET_IFNAME") -> None:
    """Make groups this process creates from now on bind the interface it reaches ``host``
    from, through ``variable`` (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) unless set."""
    if os.environ.get(variable):
        return
    name = interface_of(local_address_towards(host))
    if name is not None:
        os.environ[variable] = name
