"""The listening side of ``rlpost serve``: which addresses are safe, and slow clients.

uvicorn's h11 protocol has no header timeout: a connection that never sends a byte, or
trickles its head (slowloris), holds its slot for ever. :func:`guarded_h11` closes one whose
request head is not complete ``header_timeout`` seconds after it opened or after the first
byte of a later request (also bounding the rest of a body the server answered unread); heads
are bounded in size by h11 (16 KiB). A response that cannot drain for ``write_timeout``
seconds (the client stopped reading) has its connection aborted, and its request frees its
slots. The kernel send buffer is :data:`SEND_BUFFER` bytes rather than autotuned to
``tcp_wmem`` (4 MiB), so a stalled client blocks the response early and a thousand of them
hold no gigabytes of kernel memory.
"""

from __future__ import annotations

import contextlib
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rlpost.sync.listen import is_loopback

WRITE_TIMEOUTS = [0]  # connections cut because their responses did not drain (/health)
SEND_BUFFER = 64 << 10  # doubled by the kernel: 1.3 MB/s a connection at a 100 ms round trip


def bind_refusal(
    host: str, api_key: str | None, admin_key: str | None, insecure: bool
) -> str | None:
    """The one-line reason to refuse binding ``host``, or None when it may be bound.

    A non-loopback address needs both keys unless ``insecure``; the caller
    warns when it binds one insecurely."""
    if api_key and admin_key and api_key == admin_key:
        return "--admin-key must differ from --api-key (the API key would unlock /v1/sync)"
    if is_loopback(host) or (api_key and admin_key) or insecure:
        return None
    missing = [
        flag for flag, key in (("--api-key", api_key), ("--admin-key", admin_key)) if not key
    ]
    return (
        f"refusing to listen on {host}, which is not a loopback address, without "
        f"{' and '.join(missing)} (or RLPOST_API_KEY / RLPOST_ADMIN_KEY); --insecure binds it anyway"
    )


def guarded_h11(header_timeout: float, write_timeout: float = 30.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a timeout on receiving each request head, and one on
    a response that cannot drain (a client that stopped reading)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer = None
        _write_timer = None

        def pause_writing(self) -> None:
            # The transport's buffer passed its high-water mark: the client is not reading
            # as fast as we write. A zero TCP window would hold the send, the request's
            # batch slots and the buffer for ever; abort unless it drains in time.
            super().pause_writing()
            self._arm_write()

        def resume_writing(self) -> None:
            self._cancel("_write_timer")
            super().resume_writing()

        def timeout_keep_alive_handler(self) -> None:
            super().timeout_keep_alive_handler()
            # close() waits for the buffer to drain: bytes a client never reads would keep
            # the connection open for ever.
            if self.transport.get_write_buffer_size():
                self._arm_write()

        def _arm_write(self) -> None:
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_timed_out)

        def _cancel(self, timer: str) -> None:
            if getattr(self, timer) is not None:
                getattr(self, timer).cancel()
                setattr(self, timer, None)

        def _write_timed_out(self) -> None:
            self._write_timer = None
            WRITE_TIMEOUTS[0] += 1
            self.transport.abort()  # connection_lost follows: the request sees a disconnect

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._rearm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # An idle kept-alive connection is the keep-alive timer's; only a body
            # still arriving after the answer is this one's.
            self._rearm(idle_counts=False)

        def _waiting(self, idle_counts: bool = True) -> bool:
            """Waiting on the client alone: for a whole request head, or for the rest of a
            body after the answer went out (a refusal; uvicorn reads past the body)."""
            their = self.conn.their_state
            answered = self.conn.our_state is h11.DONE
            return (idle_counts and their is h11.IDLE) or (answered and their is h11.SEND_BODY)

        def _rearm(self, idle_counts: bool = True) -> None:
            if not self._waiting(idle_counts):
                self._cancel("_head_timer")
            elif self._head_timer is None:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._cancel("_head_timer")
            self._cancel("_write_timer")
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
