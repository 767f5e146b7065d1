"""``rollout.engine=remote``: the rollout protocol over HTTP rollout servers.

Each prompt is one ``/v1/completions`` request with ``n = G``, so a group is sampled (and its
prompt prefilled) on one server; :class:`~rlpost.rollout.engines.client.RequestLoadBalancer`
spreads and re-sends. Request seeds come from ``engine.generator``, so a run is reproducible
against the same servers and checkpointing the generator suffices.

Generation works against ``rlpost serve``, ``vllm serve`` and SGLang. Weights reach rlpost
servers' ``/v1/sync`` routes from the run's weight path (:mod:`rlpost.pipeline.weights`), a
stock ``vllm serve`` through its development routes (``rollout.engine.server=vllm``,
:mod:`rlpost.rollout.engines.vllm_server`); ``server=openai`` takes none (evaluation only). The
path then calls :meth:`RemoteEngine.weights_served`: a server that missed the update leaves
the rotation; the update fails only if no server took it. ``load_weights`` does the same push
for a script driving an engine of its own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

import torch

from rlpost.resolved import ENGINES
from rlpost.rollout.engines.client import (
    CompletionClient,
    Job,
    RequestLoadBalancer,
    keys_from_env,
    seeds_from,
)
from rlpost.rollout.engines.continuous import VersionedCompletion
from rlpost.rollout.engines.protocol import SamplingParams, TokenRate, prompt_seeds
from rlpost.sync import SyncError, SyncStats, TransportOptions, WeightSync, make_transport

FINISH_REASONS = ("stop", "length")


class RemoteEngine(TokenRate):
    """A rollout engine whose model lives in one or more rollout servers."""

    def __init__(
        self,
        urls: list[str],
        tokenizer,
        *,
        model: str | None = None,
        timeout: float = 120.0,
        max_inflight_per_server: int = 8,
        cooldown_s: float = 10.0,
        seed: int = 0,
        version: int = 0,
        extra_body: dict | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
        weight_sync: WeightSync | None = None,
        seedless: Iterable[str] = (),
    ) -> None:
        if not urls:
            raise ValueError(
                "rollout.engine=remote needs at least one server URL in rollout.engine.servers"
            )
        self.tokenizer = tokenizer
        self.extra_body = dict(extra_body or {})  # merged into every request body
        self.version = version
        self.generator = torch.Generator().manual_seed(seed)
        self.clients = [
            CompletionClient(u, timeout=timeout, model=model, api_key=api_key) for u in urls
        ]
        seedless = {u.rstrip("/") for u in seedless}
        for client in self.clients:
            client.seeds = client.url not in seedless
        self.balancer = RequestLoadBalancer(
            self.clients, max_inflight=max_inflight_per_server, cooldown_s=cooldown_s
        )
        self.stale_answers = 0
        self.urls, self.admin_key, self.timeout = list(urls), admin_key, timeout
        self.weight_sync = weight_sync  # load_weights only: a run pushes through its own path
        self.last_sync: SyncStats | None = None

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1, group_offset: int = 0
    ) -> list[VersionedCompletion]:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        tag = uuid.uuid4().hex[:12]
        seeds = prompt_seeds(params.seed, len(prompt_ids))
        if params.seed is None:  # a fixed seed leaves the engine's stream untouched
            seeds = seeds_from(self.generator, len(prompt_ids))
        jobs = [
            Job(f"{tag}-{i}", list(p), params, n, seed, self.extra_body)
            for i, (p, seed) in enumerate(zip(prompt_ids, seeds, strict=True))
        ]
        start, served = time.perf_counter(), self.version
        results = self._run(jobs)
        self.seconds += time.perf_counter() - start
        out = []
        for i, job in enumerate(jobs):
            choices = results[job.id]
            if len(choices) != n:
                raise RuntimeError(f"server returned {len(choices)} choices for n={n}")
            for c in choices:
                # A server that does not say (vllm serve) served the version current when
                # the jobs went out, or a newer one: never an older one.
                version = c.policy_version if c.policy_version is not None else served
                spans = c.versions or [version]
                per_token = [version] * len(c.token_ids) if len(spans) == 1 else None
                reason = c.finish_reason if c.finish_reason in FINISH_REASONS else "abort"
                completion = VersionedCompletion(
                    prompt_ids=list(job.prompt_ids),
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    finish_reason=reason,
                    policy_version=version,
                    group=group_offset + i,
                    text=c.text,
                    versions=spans,
                    token_versions=per_token,
                )
                out.append(completion)
                self.tokens_generated += len(c.token_ids)
        return out

    def _run(self, jobs: list[Job]) -> dict:
        """Balancer results; answers from a server behind on weights are re-sent elsewhere.

        A restarted server comes back with old weights: it leaves the rotation
        until the next weight push reaches it, and its jobs are re-sent."""
        results: dict = {}
        todo, current = jobs, self.version
        for _ in range(len(self.clients) + 1):
            served_by: dict[str, str] = {}
            eos = self.tokenizer.eos_token_id
            got = self.balancer.run(todo, self._tokenize, eos, served_by.__setitem__)
            stale = {
                j for j, cs in got.items() if any(_older(c.policy_version, current) for c in cs)
            }
            for job_id in stale:
                self.balancer.disable(served_by[job_id])
                self.stale_answers += 1
            results.update({j: cs for j, cs in got.items() if j not in stale})
            todo = [j for j in todo if j.id in stale]
            if not todo:
                return results
        raise RuntimeError(
            f"no rollout server serves policy version {self.version}; push weights again"
        )

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the weights to every server (``weight_sync``, default: plain buckets over
        http to rlpost servers); servers that fail leave the rotation. A training run does
        not call this: its weight path pushes."""
        if self.weight_sync is None:
            # weight-sync routes sit behind the server's admin key
            admin = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
            options = TransportOptions(timeout_s=self.timeout, headers=admin)
            self.weight_sync = WeightSync([make_transport("http", u, options) for u in self.urls])
        try:
            stats = self.weight_sync.push(named_tensors, version)
        except SyncError:
            self.weights_served(version, [], [c.url for c in self.clients])
            raise
        self.weights_served(version, stats.committed, list(stats.failed))
        self.last_sync = stats

    def weights_served(self, version: int, committed: list[str], failed: list[str]) -> None:
        """``version`` reached the servers in ``committed``: they serve from now on; those in
        ``failed`` (behind) leave the rotation until a later push reaches them."""
        for url in failed:
            self.balancer.disable(url)
        for url in committed:
            self.balancer.enable(url)
        if committed:
            self.version = version

    def close(self) -> None:
        self.balancer.close()
        if self.weight_sync is not None:
            self.weight_sync.close()


@ENGINES.register("remote", loads_own_weights=True, over_http=True)
def build(cfg, facts, model, tokenizer) -> RemoteEngine:
    """The remote engine for ``rollout.engine=remote``: servers from ``rollout.engine.servers``,
    keys from the environment variables ``rollout.engine.api_key_env`` and
    ``rollout.engine.admin_key_env`` name (``facts`` and ``model`` unused)."""
    r = cfg.rollout
    keys = keys_from_env(r.engine.api_key_env, r.engine.admin_key_env)
    sync, seedless = None, []
    if r.engine.server == "vllm":
        from rlpost.rollout.engines.vllm_server import build_sync

        sync = build_sync(cfg)
        seedless = sync.seedless()  # they sample from the engine's own seed, as vllm.py's does
    return RemoteEngine(
        list(r.engine.servers),
        tokenizer,
        model=r.engine.server_model,
        timeout=r.engine.server_timeout_s,
        seed=cfg.run.seed,
        weight_sync=sync,
        seedless=seedless,
        **keys,
    )


def _older(served: int | None, current: int) -> bool:
    return served is not None and served < current
