"""Long-tail control: length-aware batching and partial rollout.

* **Length-aware batching.** :func:`bucket_by_length` groups prompts of similar predicted length.
* **Partial rollout** (Kimi k1.5, section 2.6.2; AReaL). :class:`PartialRollout` ends a step
  once ``fraction`` of its samples are done. Whole groups train; the others are carried and
  continue by re-prefilling prompt + tokens (:meth:`PartialRollout.flush`).

A completion's ``policy_version`` is that of its *first* token; ``versions`` lists all it spans.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rlpost.rollout.engines.continuous import VersionedCompletion
from rlpost.rollout.engines.protocol import RolloutEngine, SamplingParams
from rlpost.types import Completion, FinishReason, Prompt


class LengthPredictor:
    """EMA of response lengths per prompt uid, per task and overall (most specific first)."""

    def __init__(self, alpha: float = 0.3, default: float = 0.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self.alpha = alpha
        self.default = default
        self.by_uid: dict[str, float] = {}
        self.by_task: dict[str, float] = {}
        self.overall: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe(self, prompt: Prompt, lengths: Iterable[int]) -> None:
        """Record the response lengths [tokens] of one prompt's samples."""
        values = list(lengths)
        if not values:
            return
        mean = sum(values) / len(values)
        if prompt.uid:
            self.by_uid[prompt.uid] = self._ema(self.by_uid.get(prompt.uid), mean)
        task = str(prompt.metadata.get("task", ""))
        self.by_task[task] = self._ema(self.by_task.get(task), mean)
        self.overall = self._ema(self.overall, mean)

    def predict(self, prompt: Prompt) -> float:
        if prompt.uid in self.by_uid:
            return self.by_uid[prompt.uid]
        task = str(prompt.metadata.get("task", ""))
        if task in self.by_task:
            return self.by_task[task]
        return self.overall if self.overall is not None else self.default

    def state_dict(self) -> dict:
        return {"by_uid": dict(self.by_uid), "by_task": dict(self.by_task), "overall": self.overall}

    def load_state_dict(self, state: dict) -> None:
        self.by_uid, self.by_task = dict(state["by_uid"]), dict(state["by_task"])
        self.overall = state["overall"]


def bucket_by_length(
    prompts: list[Prompt], predictor: LengthPredictor, n_buckets: int
) -> list[list[int]]:
    """Indices of ``prompts`` in ``n_buckets`` near-equal buckets of ascending predicted length."""
    if n_buckets < 1:
        raise ValueError(f"n_buckets={n_buckets} must be >= 1")
    order = sorted(range(len(prompts)), key=lambda i: predictor.predict(prompts[i]))
    size, extra = divmod(len(order), n_buckets)
    buckets, start = [], 0
    for b in range(n_buckets):
        end = start + size + (1 if b < extra else 0)
        if end > start:
            buckets.append(order[start:end])
        start = end
    return buckets


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # distinct, in the order they produced tokens
    token_versions: list[int] = field(default_factory=list)  # one per token
    finish: FinishReason | None = None


@dataclass
class _Group:
    prompt_ids: list[int]
    payload: Any
    samples: list[_Sample]
    steps_carried: int = 0

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)


@dataclass
class PartialStep:
    """What one step trains on: whole groups (``payloads[g]``: the caller's), and the carry."""

    completions: list[VersionedCompletion]
    payloads: list[Any]
    carried_groups: int
    carried_samples: int
    done_fraction: float
    chunks: int = 0  # engine calls in chunks of tokens (episodes: 0)


class PartialRollout:
    """Generates a step's samples, finishing it once ``fraction`` of all pending samples are done.

    ``params.max_tokens`` bounds a sample across steps; an engine without ``generate_partial``
    is driven in chunks of ``chunk_tokens``."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        fraction: float = 0.8,
        chunk_tokens: int | None = None,
        tokenizer=None,
    ) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"partial rollout fraction={fraction} must be in (0, 1]")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.engine = engine
        self.fraction = fraction
        self.chunk_tokens = chunk_tokens
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.pending: list[_Group] = []

    @property
    def carried_samples(self) -> int:
        return sum(1 for g in self.pending for s in g.samples if s.finish is None)

    def step(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int,
        payloads: list[Any] | None = None,
        *,
        fraction: float | None = None,
    ) -> PartialStep:
        """Add these prompts to the carried ones and run until ``fraction`` is done."""
        payloads = payloads if payloads is not None else [None] * len(prompt_ids)
        if len(payloads) != len(prompt_ids):
            raise ValueError(f"{len(payloads)} payloads for {len(prompt_ids)} prompts")
        if any(not p for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        for g in self.pending:
            g.steps_carried += 1
        self.pending += [
            _Group(list(p), x, [_Sample() for _ in range(n)])
            for p, x in zip(prompt_ids, payloads, strict=True)
        ]
        return self._run(params, self.fraction if fraction is None else fraction)

    def flush(self, params: SamplingParams) -> PartialStep:
        """Finish every carried sample (end of training) and return their groups."""
        return self._run(params, 1.0)

    def _run(self, params: SamplingParams, fraction: float) -> PartialStep:
        samples = [s for g in self.pending for s in g.samples]
        target = math.ceil(fraction * len(samples) - 1e-9)
        chunk = self.chunk_tokens or max(8, params.max_tokens // 4)
        rounds = 0
        while True:
            done = sum(s.finish is not None for s in samples)
            if done == len(samples) or (done >= target and any(g.done for g in self.pending)):
                break
            if hasattr(self.engine, "generate_partial"):
                self._decode_until(params, target - done)
            else:
                self._decode_chunk(params, chunk)
            rounds += 1
        ready = [g for g in self.pending if g.done]
        self.pending = [g for g in self.pending if not g.done]
        return PartialStep(
            completions=[c for i, g in enumerate(ready) for c in self._completions(g, i)],
            payloads=[g.payload for g in ready],
            carried_groups=len(self.pending),
            carried_samples=self.carried_samples,
            chunks=rounds,
            done_fraction=done / max(1, len(samples)),
        )

    def state_dict(self) -> dict:
        """The carried groups (tokens, logprobs, versions, payloads): a checkpoint resumes them."""
        groups = [{**vars(g), "samples": [asdict(x) for x in g.samples]} for g in self.pending]
        return {"pending": groups}

    def load_state_dict(self, state: dict) -> None:
        self.pending = [
            _Group(**{**g, "samples": [_Sample(**x) for x in g["samples"]]})
            for g in state["pending"]
        ]

    def _active_rows(self) -> list[tuple[_Group, _Sample]]:
        return [(g, s) for g in self.pending for s in g.samples if s.finish is None]

    def _decode_until(self, params: SamplingParams, needed: int) -> None:
        """One ``generate_partial`` call that stops once ``needed`` more samples are done
        and at least one group is whole."""
        rows = self._active_rows()
        by_group: dict[int, list[int]] = {}
        for i, (g, _) in enumerate(rows):
            by_group.setdefault(id(g), []).append(i)
        whole_already = any(g.done for g in self.pending)

        def enough(finished: list[int]) -> bool:
            if len(finished) < needed:
                return False
            fin = set(finished)
            return whole_already or any(all(i in fin for i in idx) for idx in by_group.values())

        ids = [g.prompt_ids + s.tokens for g, s in rows]
        budgets = [replace(params, max_tokens=params.max_tokens - len(s.tokens)) for _, s in rows]
        out = self.engine.generate_partial(ids, budgets, enough)
        for (_, s), c in zip(rows, out, strict=True):
            self._absorb(s, c, params)

    def _decode_chunk(self, params: SamplingParams, chunk: int) -> None:
        """Up to ``chunk`` more tokens for every unfinished sample."""
        fresh = [
            g for g in self.pending if all(s.finish is None and not s.tokens for s in g.samples)
        ]
        by_size: dict[int, list[_Group]] = {}
        for g in fresh:
            by_size.setdefault(len(g.samples), []).append(g)
        first = replace(params, max_tokens=min(chunk, params.max_tokens))
        for n, groups in by_size.items():
            out = self.engine.generate([g.prompt_ids for g in groups], first, n=n)
            for s, c in zip((s for g in groups for s in g.samples), out, strict=True):
                self._absorb(s, c, params)
        started = {id(g) for g in fresh}
        rows = [(g, s) for g, s in self._active_rows() if id(g) not in started]
        budget = [min(chunk, params.max_tokens - len(s.tokens)) for _, s in rows]
        # One call per distinct budget keeps max_tokens exact; usually there are one or two.
        for limit in sorted(set(budget)):
            batch = [r for r, b in zip(rows, budget, strict=True) if b == limit]
            ids = [g.prompt_ids + s.tokens for g, s in batch]
            out = self.engine.generate(ids, replace(params, max_tokens=limit), n=1)
            for (_, s), c in zip(batch, out, strict=True):
                self._absorb(s, c, params)

    @staticmethod
    def _absorb(s: _Sample, c: Completion, params: SamplingParams) -> None:
        """Append a continuation to its sample; it is done at a stop or at ``max_tokens``."""
        s.tokens += c.token_ids
        s.logprobs += c.logprobs
        s.token_versions += c.versions_per_token()
        for v in (getattr(c, "versions", None) or [c.policy_version]) if c.token_ids else []:
            if v not in s.versions:
                s.versions.append(v)
        if c.finish_reason == "stop":
            s.finish = "stop"
        elif len(s.tokens) >= params.max_tokens:
            s.finish = "length"

    def _completions(self, g: _Group, group: int) -> list[VersionedCompletion]:
        def text(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

        return [
            VersionedCompletion(
                prompt_ids=list(g.prompt_ids),
                token_ids=s.tokens,
                logprobs=s.logprobs,
                finish_reason=s.finish,
                policy_version=s.versions[0],
                group=group,
                text=text(s.tokens),
                versions=sorted(set(s.versions)),
                token_versions=list(s.token_versions),
            )
            for s in g.samples
        ]
