"""HTTP client for rollout servers, and a load balancer over several of them.

The wire format is the OpenAI completions API with token-id prompts (``rlpost serve``, ``vllm
serve``, SGLang). The sampled ids come from ``choices[i].token_ids``, else vLLM's
``logprobs.tokens`` (``token_id:N``), else the re-tokenized text, its count checked against the
logprobs (a mismatch is an error); the policy version from ``policy_version``, else the caller's.

:class:`RequestLoadBalancer` sends each job (a prompt with its whole group) to the healthy server
with the fewest outstanding requests. A timeout or 5xx benches a server for a cool-down, a refused
connection until a weight push reaches it again; only unfinished jobs are re-queued, keyed by job
id, so no prompt is lost or counted twice. A 4xx is raised at once; with no server left, a
:class:`~rlpost.errors.WorkerError` (``rollout``, ``lost``)."""

from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import httpx
import torch

from rlpost.errors import WorkerError, http_error_line
from rlpost.rollout.engines.protocol import SamplingParams

TOKEN_ID_PREFIX = "token_id:"


class ServerUnavailable(RuntimeError):
    """A server that could not answer (connection, timeout, 5xx, or busy: 408 / 429): worth
    retrying elsewhere. ``retry_after``: seconds the server asked to be left alone; ``gone``:
    it refused the connection (nothing listens there now)."""

    def __init__(self, message: str, retry_after: float | None = None, gone: bool = False) -> None:
        super().__init__(message)
        self.retry_after, self.gone = retry_after, gone


BUSY = (408, 429)  # the request timed out waiting, or too many are pending: not its fault


class RequestRejected(ValueError):
    """A server refused the request (4xx): retrying elsewhere would not help."""


@dataclass
class Choice:
    """One sample as a server returned it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    policy_version: int | None = None
    versions: list[int] = field(default_factory=list)


@dataclass
class Job:
    """One prompt and its group size; ``seed`` makes the server's samples reproducible.

    ``extra`` is merged into the request body (server-specific options, e.g. vLLM's ``ignore_eos``).
    """

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    seed: int | None = None
    extra: dict = field(default_factory=dict)


def savable(named_tensors) -> dict[str, torch.Tensor]:
    """``(name, tensor)`` pairs as CPU tensors safetensors can save: a tied tensor is copied
    once per further name (safetensors refuses two names sharing memory)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in named_tensors:
        t = tensor.detach().cpu().contiguous()
        tensors[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    return tensors


def completion_body(job: Job, model: str | None) -> dict:
    """The ``/v1/completions`` request for a job (extra fields are vLLM's names for the same things)."""
    p = job.params
    body = {
        "prompt": job.prompt_ids,
        "n": job.n,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "logprobs": 0,
        "stop_token_ids": list(p.stop_token_ids),
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if p.stop_texts:
        body["stop"] = list(p.stop_texts)
    if model is not None:
        body["model"] = model
    if job.seed is not None:
        body["seed"] = job.seed
    return {**body, **job.extra}


def parse_choices(response: dict, tokenize=None, eos_id: int | None = None) -> list[Choice]:
    """Choices of a completions response in index order, with token ids recovered if needed:
    ``tokenize(text) -> ids`` when the server sends none, and ``eos_id`` appended when a stopped
    sample's logprobs count one more token than its text (the end-of-sequence token has none)."""
    top_version = response.get("policy_version")
    choices = sorted(response.get("choices", []), key=lambda c: c.get("index", 0))
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        ids = c.get("token_ids")
        if ids is None:
            ids = _ids_from_logprob_tokens(lp.get("tokens")) or _retokenize(
                c, tokenize, logprobs, eos_id
            )
        if logprobs is None or len(logprobs) != len(ids):
            count = "no" if logprobs is None else len(logprobs)
            raise ValueError(
                f"server returned {len(ids)} token ids but {count} logprobs for one choice"
            )
        version = c.get("policy_version", top_version)
        versions = c.get("policy_versions") or ([version] if version is not None else [])
        lps = [float(x) if x is not None else -math.inf for x in logprobs]
        reason, text = c.get("finish_reason") or "abort", c.get("text", "")
        out.append(Choice([int(t) for t in ids], lps, reason, text, version, versions))
    return out


def _ids_from_logprob_tokens(tokens) -> list[int] | None:
    if not tokens or not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        return None
    return [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]


def _retokenize(choice: dict, tokenize, logprobs, eos_id) -> list[int]:
    if tokenize is None:
        raise ValueError("server returned no token ids and no tokenizer was given to recover them")
    ids = list(tokenize(choice.get("text", "")))
    stopped = choice.get("finish_reason") == "stop"
    if logprobs is not None and stopped and eos_id is not None and len(logprobs) == len(ids) + 1:
        ids.append(eos_id)
    return ids


class CompletionClient:
    """Synchronous client of one server; safe to share between threads. ``api_key`` is sent as a
    Bearer token with generation requests (``rlpost serve --api-key``); weights go through the
    ``http`` sync channel, with the admin key. ``seeds=False`` leaves the jobs' seeds out (a server
    that cannot take them)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 120.0,
        model: str | None = None,
        api_key: str | None = None,
        seeds: bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.model, self.seeds = model, seeds
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self._auth = _bearer(api_key)

    def __repr__(self) -> str:  # never shows the keys
        return f"CompletionClient({self.url!r})"

    def complete(self, job: Job, tokenize=None, eos_id: int | None = None) -> list[Choice]:
        body = completion_body(job if self.seeds else replace(job, seed=None), self.model)
        data = self._post("/v1/completions", json=body, headers=self._auth)
        return parse_choices(data, tokenize, eos_id)

    def health(self) -> dict:
        try:
            r = self.http.get("/health")
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        return r.json()

    def _post(self, path: str, **kwargs) -> dict:
        try:
            r = self.http.post(path, **kwargs)
        except httpx.TransportError as exc:  # connection refused/reset, timeouts
            why = f"{self.url}{path}: {type(exc).__name__}: {exc}"
            raise ServerUnavailable(why, gone=isinstance(exc, httpx.ConnectError)) from None
        if r.status_code >= 500 or r.status_code in BUSY:
            why = f"{self.url}{path}: HTTP {r.status_code}: {http_error_line(r)}"
            raise ServerUnavailable(why, retry_after=_retry_after(r))
        if r.status_code >= 400:
            raise RequestRejected(f"{self.url}{path}: HTTP {r.status_code}: {http_error_line(r)}")
        return r.json()

    def close(self) -> None:
        self.http.close()


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def keys_from_env(api_key_env: str | None, admin_key_env: str | None) -> dict[str, str | None]:
    """``api_key`` and ``admin_key`` read from the environment variables these name."""
    import os

    names = {"api_key": api_key_env, "admin_key": admin_key_env}
    return {key: (os.environ.get(name) or None) if name else None for key, name in names.items()}


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return max(0.0, float(r.headers["retry-after"]))
    except (KeyError, ValueError):  # absent, or an HTTP date: the balancer's cool-down
        return None


@dataclass
class _Server:
    client: CompletionClient
    outstanding: int = 0
    down_until: float = 0.0
    completed: int = 0
    failures: int = 0


class RequestLoadBalancer:
    """Runs jobs over several servers: fewest outstanding requests first, failed jobs re-sent.

    ``max_inflight`` bounds the requests outstanding at one server; ``cooldown_s`` is how long a
    failed server sits out (one that refused the connection: until :meth:`enable`);
    ``max_attempts`` per job (None: 2 per server) bounds retries before :class:`WorkerError` names
    the last failure."""

    def __init__(
        self,
        clients: list[CompletionClient],
        *,
        max_inflight: int = 8,
        cooldown_s: float = 10.0,
        max_attempts: int | None = None,
    ) -> None:
        if not clients:
            raise ValueError("the load balancer needs at least one server URL")
        self.servers = [_Server(c) for c in clients]
        self.max_inflight = max_inflight
        self.cooldown_s = cooldown_s
        self.max_attempts = max_attempts or 2 * len(clients)
        self.retries = 0
        self._pool = ThreadPoolExecutor(max_workers=max_inflight * len(clients))

    def run(
        self, jobs: list[Job], tokenize=None, eos_id=None, on_result=None
    ) -> dict[str, list[Choice]]:
        """Results keyed by job id, each job answered exactly once; ``on_result(job_id, url)`` observes."""
        ids = [j.id for j in jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("job ids must be unique")
        queue = list(jobs)
        attempts = dict.fromkeys(ids, 0)
        results: dict[str, list[Choice]] = {}
        inflight: dict[Future, tuple[Job, _Server]] = {}
        last_error: dict[str, str] = {}
        while queue or inflight:
            while queue and (server := self._pick()) is not None:
                job = queue.pop(0)
                attempts[job.id] += 1
                server.outstanding += 1
                fut = self._pool.submit(server.client.complete, job, tokenize, eos_id)
                inflight[fut] = (job, server)
            if not inflight:
                if math.isinf(self._next_up()):
                    last = f"; last: {next(reversed(last_error.values()))}" if last_error else ""
                    raise _lost(f"every rollout server is out of rotation{last}")
                time.sleep(min(0.5, max(0.01, self._next_up() - time.monotonic())))
                continue
            done, _ = wait(list(inflight), timeout=1.0, return_when=FIRST_COMPLETED)
            for fut in done:
                job, server = inflight.pop(fut)
                server.outstanding -= 1
                try:
                    choices = fut.result()
                except ServerUnavailable as exc:
                    self._mark_down(server, exc)
                    last_error[job.id] = str(exc)
                    if attempts[job.id] >= self.max_attempts:
                        self._abandon(inflight)
                        why = f"job {job.id} failed on {attempts[job.id]} attempts; last: {exc}"
                        raise _lost(why) from None
                    self.retries += 1
                    queue.insert(0, job)
                    continue
                except Exception:
                    self._abandon(inflight)
                    raise
                if job.id not in results:
                    results[job.id] = choices
                    server.completed += 1
                    if on_result is not None:
                        on_result(job.id, server.client.url)
        return results

    def _pick(self) -> _Server | None:
        now = time.monotonic()
        ready = [
            s for s in self.servers if s.down_until <= now and s.outstanding < self.max_inflight
        ]
        return min(ready, key=lambda s: s.outstanding) if ready else None

    def _next_up(self) -> float:
        return min(s.down_until for s in self.servers)

    def _mark_down(self, server: _Server, exc: ServerUnavailable) -> None:
        server.failures += 1
        wait_s = min(self.cooldown_s, math.inf if exc.retry_after is None else exc.retry_after)
        server.down_until = math.inf if exc.gone else time.monotonic() + wait_s

    def _abandon(self, inflight: dict) -> None:
        for fut in inflight:
            fut.cancel()
        for _, server in inflight.values():
            server.outstanding -= 1

    def disable(self, url: str, seconds: float = math.inf) -> None:
        """Keep ``url`` out of rotation (e.g. it missed a weight update)."""
        for s in self.servers:
            if s.client.url == url.rstrip("/"):
                s.down_until = time.monotonic() + seconds

    def enable(self, url: str) -> None:
        """Put ``url`` back in rotation (it answered, e.g. took the latest weights)."""
        self.disable(url, 0.0)

    def stats(self) -> dict:
        now = time.monotonic()
        servers = {
            s.client.url: {
                "completed": s.completed,
                "failures": s.failures,
                "outstanding": s.outstanding,
                "up": s.down_until <= now,
            }
            for s in self.servers
        }
        return {"retries": self.retries, "servers": servers}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for s in self.servers:
            s.client.close()


def _lost(why: str) -> WorkerError:
    return WorkerError("rollout", "lost", f"rollout servers: {why}")


def seeds_from(generator: torch.Generator, count: int) -> list[int]:
    """``count`` request seeds drawn from ``generator`` (reproducible rollouts across restarts)."""
    return torch.randint(0, 2**31 - 1, (count,), generator=generator).tolist()
