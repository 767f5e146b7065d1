"""Recorded sessions on remote ``rlpost serve`` servers (``rollout.engine=remote``).

The interface of :class:`rlpost.rollout.serve.sessions.SessionStore` over the servers' admin
routes: sessions open on the servers in turn, and a closed one's record becomes a
:class:`~rlpost.rollout.serve.sessions.Session`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import asdict

import httpx

from rlpost.errors import http_error_line
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.serve.sessions import Session, SessionBounds, session_from_record


class RemoteSessions:
    """Sessions spread round-robin over ``urls``; each remembers the server it lives on."""

    def __init__(self, urls: list[str], admin_key: str | None, timeout: float = 30.0) -> None:
        if not urls:
            raise ValueError(
                "agent.harness with rollout.engine=remote needs rollout.engine.servers"
            )
        self.urls = [u.rstrip("/") for u in urls]
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)
        self._turn = itertools.cycle(range(len(self.urls)))
        self._open: dict[str, tuple[str, Session]] = {}
        self._lock = threading.Lock()

    def open(
        self, bounds: SessionBounds, sampling: SamplingParams, seed: int | None = None
    ) -> Session:
        chosen = {"temperature": sampling.temperature, "top_p": sampling.top_p}
        body = {**asdict(bounds), **chosen, "top_k": sampling.top_k}
        if seed is not None:
            body["seed"] = seed
        url, sid, key = self._open_somewhere(body)
        session = Session(sid, bounds, sampling, seed=seed, key=key)
        with self._lock:
            self._open[sid] = (url, session)
        return session

    def _open_somewhere(self, body: dict) -> tuple[str, str, str]:
        """(server, session id, session key) on the next server in turn; one that fails passes the turn on
        (RuntimeError with the last failure when none opens it)."""
        with self._lock:
            start = next(self._turn)
        error = ""
        for k in range(len(self.urls)):
            url = self.urls[(start + k) % len(self.urls)]
            try:
                opened = self._call("post", f"{url}/v1/sessions", json=body)
                return url, str(opened["id"]), str(opened["key"])
            except (RuntimeError, KeyError, TypeError) as exc:
                error = str(exc)
        raise RuntimeError(f"no rollout server opened a session: {error}")

    def base_url(self, sid: str) -> str:
        """The OpenAI base URL the agent is given for session ``sid``."""
        with self._lock:
            url = self._open[sid][0]
        return f"{url}/sessions/{sid}/v1"

    def close(self, sid: str) -> Session | None:
        """Close ``sid`` on its server: the recorded session, or None (closed already)."""
        with self._lock:
            entry = self._open.pop(sid, None)
        if entry is None:
            return None
        url, local = entry
        record = self._call("delete", f"{url}/v1/sessions/{sid}")
        return session_from_record(record, local.bounds, local.sampling)

    def _call(self, method: str, url: str, **kwargs) -> dict:
        try:
            r = self.http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{method.upper()} {url}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise RuntimeError(f"{method.upper()} {url}: {r.status_code} {http_error_line(r)}")
        return r.json()

    def __len__(self) -> int:
        return len(self._open)

    def close_all(self) -> None:
        """Close what is still open (best effort) and the HTTP client."""
        for sid in list(self._open):
            with contextlib.suppress(RuntimeError):  # a server that cannot close it already lost it
                self.close(sid)
        self.http.close()
