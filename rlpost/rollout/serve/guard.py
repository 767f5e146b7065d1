"""Who may call ``rlpost serve``, and how much one request may ask of it.

One pure ASGI middleware in front of the whole app decides from the path and headers alone,
before any route runs and before a byte of the body is read:

* **keys**: everything but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <api
  key>`` when an API key is set (401, as vLLM). Admin prefixes (``/v1/sync``, ``/v1/admin``,
  ``/v1/sessions``) need the admin key (the API key alone: 403) and are closed
  (403) on a server without one, loopback included: any local process could otherwise replace
  the weights or read another agent's sessions. A session's own requests
  (``/sessions/<id>/v1/...completions``) pass to their route, which checks that session's key.
  The decision is by prefix, so a route mounted under ``/v1/sync`` later is guarded too. Keys
  are compared as SHA-256 digests with :func:`hmac.compare_digest` and never logged.
* **body size**: a ``Content-Length`` above the limit is a 413 at once; a chunked body is
  counted as it arrives.
* **bodies first**: a generation request's body is read whole within the short body timeout
  (408) before it counts as pending, so a client trickling its body holds no slot; a control
  route's body (a weight bucket) streams to its route within the request timeout.
* **pending sequences** (prompts x n, running or queued) are bounded by
  :class:`PendingBudget`: a 429 with ``Retry-After``, from the headers alone once full.

A refusal for size closes the connection; others keep it (uvicorn reads past the bounded
body).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import time
from dataclasses import dataclass

from rlpost.rollout.serve.openai_params import APIError, error_body

OPEN_PATHS = ("/health", "/metrics")
ADMIN_PREFIXES = ("/v1/sync", "/v1/admin", "/v1/sessions")
# Routes whose requests count as pending sequences (the scoring route counts its prompts).
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/prompt_logprobs")
SESSION_PATH = re.compile(r"/sessions/[0-9a-f]{1,64}/v1/(chat/)?completions")
MIB = 1 << 20
NO_ADMIN_KEY = (
    "this control endpoint (weights, sessions) is closed: the server has no admin key "
    "(start it with --admin-key or RLPOST_ADMIN_KEY)"
)


@dataclass
class GuardSettings:
    """Keys and limits of one server (the ``rlpost serve`` flags of the same names)."""

    api_key: str | None = None
    admin_key: str | None = None
    max_body_bytes: int = 16 * MIB
    max_weights_bytes: int = 65536 * MIB
    max_pending: int = 4096  # sequences (prompts x n)
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_sessions: int = 1024  # recorded agent sessions open at once

    def __repr__(self) -> str:  # keys never reach a log line or a traceback
        return f"GuardSettings(api_key={'set' if self.api_key else None}, admin_key={'set' if self.admin_key else None}, ...)"


def key_digest(key: str | None) -> bytes | None:
    return hashlib.sha256(key.encode()).digest() if key else None


def key_matches(token: str | None, digest: bytes | None) -> bool:
    """``token`` hashes to ``digest`` (compared in constant time, length included)."""
    if token is None or digest is None:
        return False
    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def is_admin_path(path: str) -> bool:
    """Under an admin prefix, as sent or with repeated slashes and dot segments removed."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            parts = parts[:-1]
        elif part not in ("", "."):
            parts.append(part)
    normal = "/" + "/".join(parts)
    return any(p.startswith(prefix) for p in (path, normal) for prefix in ADMIN_PREFIXES)


class Guard:
    """ASGI middleware enforcing :class:`GuardSettings` in front of ``app``.

    ``stats`` (shared with ``/health``) holds ``pending`` and ``refused_<status>`` counts."""

    def __init__(self, app, settings: GuardSettings, stats: dict | None = None) -> None:
        self.app, self.settings = app, settings
        self._api, self._admin = key_digest(settings.api_key), key_digest(settings.admin_key)
        self.stats = stats if stats is not None else {}
        self.stats["pending"] = 0

    def authorize(self, path: str, token: str | None) -> tuple[int, str] | None:
        """None when the request may go on, else (status, one-line reason)."""
        if path in OPEN_PATHS:
            return None
        if is_admin_path(path):
            if key_matches(token, self._admin):
                return None
            if self._admin is None:  # closed: any local process could replace the weights
                return 403, NO_ADMIN_KEY
            if key_matches(token, self._api):
                return 403, "this endpoint needs the admin key; the API key is not enough"
            return 401, "missing or wrong admin key (send Authorization: Bearer <admin key>)"
        if SESSION_PATH.fullmatch(path):  # the route checks the session's own key
            return None
        if self._api is None or key_matches(token, self._api) or key_matches(token, self._admin):
            return None
        return 401, "missing or wrong API key (send Authorization: Bearer <key>)"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], scope["headers"]
        refusal = self.authorize(path, bearer_token(headers))
        admin = is_admin_path(path)
        limit = self.settings.max_weights_bytes if admin else self.settings.max_body_bytes
        if refusal is None and _content_length(headers) > limit:
            refusal = 413, f"request body is larger than the server's limit of {limit} bytes"
        pending = self.stats["pending"]
        if refusal is None and path in GENERATE_PATHS and pending >= self.settings.max_pending:
            refusal = 429, f"the server has {pending} sequences pending; retry later"
        if refusal is None and not admin:
            body, refusal = await self._read_body(receive, limit)
            if refusal is None:
                return await self.app(scope, _replay(body, receive), send)
            return await self._refuse(send, *refusal, close=True)
        if refusal is not None:
            # A body of a known, allowed size is left for uvicorn to read past and the
            # connection kept; closing with unread bytes would reset it, and the client
            # could lose this answer. A body too large, or chunked, is not worth reading.
            chunked = any(n == b"transfer-encoding" for n, _ in headers)
            too_large = _content_length(headers) > self.settings.max_body_bytes
            close = refusal[0] == 413 or chunked or too_large
            return await self._refuse(send, *refusal, close=close)
        await self.app(scope, self._limited(receive, limit), send)

    async def _read_body(self, receive, limit: int) -> tuple[bytes, tuple[int, str] | None]:
        """The whole body within the body timeout: (body, None), or (b"", refusal)."""
        timeout = self.settings.body_timeout_s
        deadline, parts, size = time.monotonic() + timeout, [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return b"", (408, f"request body not received within {timeout} s")
            if message["type"] != "http.request":  # the client went away
                return b"", (400, "the client disconnected before sending its body")
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                return b"", (
                    413,
                    f"request body is larger than the server's limit of {limit} bytes",
                )
            if not message.get("more_body", False):
                return b"".join(parts), None

    def _limited(self, receive, limit: int):
        """``receive`` that counts body bytes and times the whole body out (control routes:
        their bodies stream to the route)."""
        timeout, state = self.settings.request_timeout_s, {"read": 0, "done": False}
        deadline = time.monotonic() + timeout

        async def limited():
            if state["done"]:  # the body is in; later calls only wait for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise APIError(408, f"request body not received within {timeout} s") from None
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
                if state["read"] > limit:
                    raise APIError(
                        413, f"request body is larger than the server's limit of {limit} bytes"
                    )
            return message

        return limited

    async def _refuse(self, send, status: int, message: str, *, close: bool) -> None:
        key = f"refused_{status}"
        self.stats[key] = self.stats.get(key, 0) + 1
        kinds = {401: "authentication_error", 403: "permission_error"}
        body = json.dumps(error_body(message, kind=kinds.get(status, "invalid_request_error")))
        body = body.encode()
        headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(body)).encode()))
        if close:
            headers.append((b"connection", b"close"))
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if status == 429:
            headers.append((b"retry-after", str(self.settings.retry_after_s).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive):
    """``receive`` that hands the app the body already read, then waits for a disconnect."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class PendingBudget:
    """Sequences (prompts x n) of accepted generation requests, bounded by ``max_pending``.

    ``stats["pending"]`` is the count ``/health`` reports as ``http.pending``."""

    def __init__(self, max_pending: int, stats: dict, retry_after_s: int = 1) -> None:
        self.max_pending, self.stats, self.retry_after_s = max_pending, stats, retry_after_s
        self.stats.setdefault("pending", 0)

    def take(self, sequences: int) -> None:
        """Count ``sequences`` as pending, or raise a 429 when they would pass the bound."""
        pending = self.stats["pending"]
        if pending and pending + sequences > self.max_pending:  # an idle server takes any
            why = f"the server has {pending} of {self.max_pending} sequences pending and this "
            why += f"request adds {sequences}; retry later"
            raise APIError(429, why, headers={"retry-after": str(self.retry_after_s)})
        self.stats["pending"] = pending + sequences

    def release(self, sequences: int) -> None:
        self.stats["pending"] -= sequences


def _content_length(headers: list[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0  # h11 has refused malformed lengths
    return 0
