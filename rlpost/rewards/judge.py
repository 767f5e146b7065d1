"""LLM-as-judge: a model behind any OpenAI-compatible endpoint grades each response.

The least reliable signal (DESIGN.md), so it never stops a run: every failure falls back to
``default_score`` and is counted, transient errors retried with backoff. ``base_url`` ends in
``/v1`` as for the OpenAI client.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlpost.rewards.registry import batched_scorer
from rlpost.types import RewardSample

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = """You are grading a response to a task.

Task:
{prompt}

Reference answer (may be empty):
{answer}

Response:
{completion}

Rate the response from 0 (wrong or useless) to 10 (correct and complete).
Reply with one line: Score: N"""

# Transient by HTTP semantics; other 4xx fail at once.
RETRYABLE_STATUS = {408, 409, 425, 429}
_PLACEHOLDER = re.compile(r"\{(prompt|completion|answer)\}")
_SCORE_LINE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(text: str) -> float | None:
    """The judge's score: the last ``Score: N`` in ``text``, else its first number."""
    marked = _SCORE_LINE.findall(text)
    if marked:
        return float(marked[-1])
    m = _FIRST_NUMBER.search(text)
    return float(m.group(0)) if m else None


def render_rubric(rubric: str, sample: RewardSample) -> str:
    """Fill ``{prompt}``, ``{completion}``, ``{answer}`` in one pass (no template injection)."""
    values = {
        "prompt": sample.prompt,
        "completion": sample.completion,
        "answer": "" if sample.answer is None else str(sample.answer),
    }
    text = _PLACEHOLDER.sub(lambda m: values[m.group(1)], rubric)
    # Model output can hold lone surrogates, which no request body can carry.
    return text.encode("utf-8", errors="replace").decode("utf-8")


@batched_scorer("judge")
class JudgeScorer:
    """Scores samples in [0, 1] by asking a judge model, retrying a transient failure after
    ``backoff * 2**k`` seconds; a failed sample scores ``default_score``."""

    default_kind = "judge"

    def __init__(
        self,
        base_url: str,
        model: str,
        rubric: str = DEFAULT_RUBRIC,
        api: str = "chat",
        timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.5,
        default_score: float | None = 0.0,
        max_score: float = 10.0,
        concurrency: int = 8,
        temperature: float = 0.0,
        max_tokens: int = 64,
        api_key_env: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"judge: base_url must start with http:// or https://, got {base_url!r}"
            )
        if api not in ("chat", "completions"):
            raise ValueError(f"judge: api must be 'chat' or 'completions', got {api!r}")
        if "{completion}" not in rubric:
            raise ValueError("judge: rubric must contain the {completion} placeholder")
        if max_score <= 0 or retries < 0 or concurrency < 1 or timeout <= 0:
            raise ValueError(
                "judge: need max_score > 0, retries >= 0, concurrency >= 1, timeout > 0"
            )
        self.url = base_url.rstrip("/") + ("/chat/completions" if api == "chat" else "/completions")
        self.model, self.rubric, self.api = model, rubric, api
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.default_score, self.max_score = default_score, max_score
        self.concurrency, self.temperature, self.max_tokens = concurrency, temperature, max_tokens
        self._headers = {}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"judge: environment variable {api_key_env} is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None

    def _count(self, name: str) -> int:
        with self._lock:
            self._counts[name] += 1
            return self._counts[name]

    def counters(self) -> dict[str, int]:
        """Cumulative ``requests``, ``retries``, ``failures`` and ``failures_<reason>``."""
        with self._lock:
            return dict(self._counts)

    def _payload(self, text: str) -> dict[str, Any]:
        body = {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens}
        chat = {"messages": [{"role": "user", "content": text}]}
        return body | (chat if self.api == "chat" else {"prompt": text})

    def _reply_text(self, data: Any) -> str:
        choice = data["choices"][0]
        text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        if not isinstance(text, str):
            raise TypeError("reply text is not a string")
        return text

    def _ask(self, text: str) -> tuple[str | None, str]:
        """The judge's reply, or ``(None, failure reason)`` after the retries."""
        import httpx

        reason = "unknown"
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                time.sleep(self.backoff * 2 ** (attempt - 1))
            self._count("requests")
            try:
                response = self._client.post(self.url, json=self._payload(text))
            except httpx.RequestError as exc:  # TimeoutException is one
                reason = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
                continue
            if response.status_code >= 500 or response.status_code in RETRYABLE_STATUS:
                reason = "http"
                continue
            if response.status_code >= 400:
                return None, "http"
            try:
                return self._reply_text(response.json()), ""
            except (ValueError, KeyError, IndexError, TypeError):
                return None, "bad_response"
        return None, reason

    def _judge_one(self, sample: RewardSample) -> float | None:
        reply, reason = self._ask(render_rubric(self.rubric, sample))
        if reply is not None:
            raw = parse_score(reply)
            if raw is not None and 0.0 <= raw <= self.max_score:
                return raw / self.max_score
            reason = "unparsable"
        self._count("failures")
        if self._count(f"failures_{reason}") == 1:
            log.warning(
                "judge %s: %s; scoring %s and counting", self.url, reason, self.default_score
            )
        return self.default_score

    def _started_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            import httpx

            self._client = httpx.Client(
                timeout=self.timeout,
                headers=self._headers,
                limits=httpx.Limits(max_connections=self.concurrency),
            )
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="judge")
        return self._pool

    def score(self, samples: Sequence[RewardSample]) -> list[float | None]:
        """Scores normalised to [0, 1] (``raw / max_score``), in order."""
        if not samples:
            return []
        return list(self._started_pool().map(self._judge_one, samples))

    def close(self) -> None:
        """Close the HTTP client and the thread pool."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None
