"""The rollout protocol over the in-process continuous-batching scheduler."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlpost.resolved import ENGINES, RunFacts
from rlpost.rollout.engines.hf import serving_copy
from rlpost.rollout.engines.prefix_cache import PrefixCache
from rlpost.rollout.engines.protocol import SamplingParams, prompt_seeds
from rlpost.rollout.engines.scheduler import GenerationRequest, SampleOutput, Scheduler
from rlpost.types import Completion


@dataclass
class VersionedCompletion(Completion):
    """A completion whose tokens may come from several policy versions (ascending in ``versions``)."""

    versions: list[int] = field(default_factory=list)


class ContinuousEngine:
    """The rollout protocol over an in-process :class:`~rlpost.rollout.engines.scheduler.Scheduler`;
    ``generate_partial``'s aborted rows come back ``finish_reason="abort"``, to be continued."""

    def __init__(self, scheduler: Scheduler, tokenizer=None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer if tokenizer is not None else scheduler.tokenizer
        self._tokens_at_reset, self._busy_at_reset = 0, 0.0

    @property
    def version(self) -> int:
        return self.scheduler.version

    @property
    def generator(self) -> torch.Generator:
        return self.scheduler.generator

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1, group_offset: int = 0
    ) -> list[VersionedCompletion]:
        seeds = prompt_seeds(params.seed, len(prompt_ids))
        requests = [
            GenerationRequest(list(p), params, n=n, seed=seed, stop_texts=params.stop_texts)
            for p, seed in zip(prompt_ids, seeds, strict=True)
        ]
        tickets = self.scheduler.submit_all(requests)
        return [
            self._completion(p, out, group_offset + i)
            for i, (p, t) in enumerate(zip(prompt_ids, tickets, strict=True))
            for out in t.future.result()
        ]

    def generate_partial(
        self,
        prompt_ids: list[list[int]],
        params: list[SamplingParams],
        enough: Callable[[list[int]], bool],
    ) -> list[VersionedCompletion]:
        """One sample per row (``params[i]``); rows unfinished once ``enough`` holds (checked on
        the scheduler's thread) are aborted at the next decode step."""
        reqs = [
            GenerationRequest(list(p), q, stop_texts=q.stop_texts)
            for p, q in zip(prompt_ids, params, strict=True)
        ]
        lock, finished, settled = threading.Lock(), [], threading.Event()
        tickets: list = []

        def on_done(row: int, future) -> None:
            with lock:
                if not future.cancelled() and future.result()[0].finish_reason != "abort":
                    finished.append(row)
                stop = len(finished) == len(reqs) or enough(list(finished))
            if stop and not settled.is_set():
                settled.set()
                for t in tickets:
                    if not t.future.done():
                        self.scheduler.cancel(t, keep_partial=True)

        # callbacks first, so the abort lands at one decode step whatever the timing
        tickets += self.scheduler.submit_all(reqs, on_done=on_done)
        if settled.is_set():  # the step was done before ``tickets`` was filled in
            for t in tickets:
                if not t.future.done():
                    self.scheduler.cancel(t, keep_partial=True)
        return [
            self._completion(p, t.future.result()[0], i)
            for i, (p, t) in enumerate(zip(prompt_ids, tickets, strict=True))
        ]

    def _completion(self, prompt: list[int], out: SampleOutput, group: int) -> VersionedCompletion:
        version = out.policy_version if out.policy_version is not None else self.version
        return VersionedCompletion(
            prompt_ids=list(prompt),
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            policy_version=version,
            group=group,
            text=self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
            versions=out.versions,
            token_versions=list(out.token_versions),
        )

    def load_weights(self, named_tensors, version: int) -> None:
        self.scheduler.load_weights(named_tensors, version)

    def throughput(self) -> float:
        """Generated tokens per busy second since the last :meth:`reset_stats`."""
        stats = self.scheduler.stats()
        tokens = stats["tokens"] - self._tokens_at_reset
        return tokens / max(stats["busy_seconds"] - self._busy_at_reset, 1e-9)

    def reset_stats(self) -> None:
        stats = self.scheduler.stats()
        self._tokens_at_reset, self._busy_at_reset = stats["tokens"], stats["busy_seconds"]

    def close(self) -> None:
        self.scheduler.stop()


@ENGINES.register("hf_continuous")
def build(cfg, facts: RunFacts, model, tokenizer) -> ContinuousEngine:
    """The continuous-batching engine for ``rollout.engine=hf_continuous``."""
    serving, batch = serving_copy(facts, model), cfg.rollout.batch_size
    scheduler = Scheduler(
        serving, tokenizer, max_batch=batch, prefix_cache=PrefixCache(), seed=cfg.run.seed
    )
    return ContinuousEngine(scheduler.start(), tokenizer)
