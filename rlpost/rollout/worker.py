"""The rollout worker: prompts in, group records out, behind a narrow interface.

It owns the engine (in-process, vLLM or remote servers), the tokenizer it
prompts with, and the long-tail state that lives between steps (partial
rollout's carried groups, the length predictor). The loop sends it prompts,
sampling parameters and weights, and gets :class:`~rlpost.types.Group`
records, never a model or a generator, so the worker can sit in another
process or a Ray actor.
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from rlpost.errors import WorkerError
from rlpost.rng import rng_state, set_rng_state
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.longtail import LengthPredictor, PartialRollout, bucket_by_length
from rlpost.sync import Receiver, SyncError
from rlpost.sync.disk import load_version
from rlpost.types import Completion, Group, Prompt


@dataclass
class RolloutResult:
    """The groups a call produced and what happened on the way (partial rollout counts)."""

    groups: list[Group]
    stats: dict[str, float] = field(default_factory=dict)
    why: str = ""  # a harness's first failed session: what the stop line says when all fail


def to_groups(
    prompts: list[Prompt], completions: list[Completion], n: int, *, by_index: bool = False
) -> list[Group]:
    """Completions ``i*n .. i*n+n-1`` answer ``prompts[i]``; ``by_index``: those whose
    ``group`` is ``i`` do (an agent harness's rows vary in number per prompt)."""
    if by_index:
        return [Group(p, [c for c in completions if c.group == i]) for i, p in enumerate(prompts)]
    if len(completions) != len(prompts) * n:
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts x n={n}")
    return [Group(p, completions[i * n : (i + 1) * n]) for i, p in enumerate(prompts)]


def weights_checksum(named_tensors) -> int:
    """CRC-32 over the names and bytes of ``(name, tensor)`` pairs, in name order."""
    crc = 0
    for name, t in sorted(named_tensors, key=lambda pair: pair[0]):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


_PARTS = ("partial", "agent", "lengths")
"""The worker's optional parts with a state of their own, saved under these keys."""


class RolloutWorker:
    """One engine and the state the training loop keeps beside it."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        partial: PartialRollout | None = None,
        lengths: LengthPredictor | None = None,
        batch_size: int = 64,
        agent=None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.partial = partial
        self.lengths = lengths
        self.batch_size = batch_size
        self.agent = agent  # a MultiTurnRollout over this engine: every sample is an episode
        self._reader: Receiver | None = None  # the disk channel's, built on first use
        self._by_index = bool(getattr(agent, "variable_groups", False))

    def _ids(self, prompts: list[Prompt]) -> list[list[int]]:
        return [self.tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        *,
        train: bool = False,
        last: bool = False,
        min_version: int | None = None,
    ) -> RolloutResult:
        """``n`` samples per prompt as :class:`Group` records.

        ``train=True`` is the training step's call: prompts go to the engine
        ordered by predicted length when length-aware batching is on, and with
        partial rollout the groups returned are those that finished (carried
        ones from earlier steps included; ``last`` waits for all). Otherwise
        (evaluation) every prompt comes back, in order.

        ``min_version`` is the version the caller last sent: a worker holding an
        older one (restarted behind the caller's back) refuses the call, so it
        never samples from weights the caller has moved past."""
        if min_version is not None and self.version() < min_version:
            why = f"holds weights version {self.version()}, was sent {min_version}"
            raise WorkerError("rollout", "behind", why)
        if not train:
            completions, stats = self._sample(prompts, self._ids(prompts), params, n)
            return RolloutResult(to_groups(prompts, completions, n, by_index=self._by_index), stats)
        if self.lengths is not None:
            per_batch = max(1, self.batch_size // n)
            buckets = bucket_by_length(prompts, self.lengths, math.ceil(len(prompts) / per_batch))
            prompts = [prompts[i] for b in buckets for i in b]
        ids = self._ids(prompts)
        if self.partial is None:
            completions, stats = self._sample(prompts, ids, params, n)
        else:
            if self.agent is not None:  # episodes carry across steps at turn boundaries
                fraction = 1.0 if last else self.partial.fraction
                out = self.agent.generate_partial(ids, params, n, prompts, fraction=fraction)
                extra = self.agent.last_stats.metrics()
            else:
                fraction = 1.0 if last else None
                out = self.partial.step(ids, params, n, payloads=prompts, fraction=fraction)
                extra = {}
            prompts, completions = out.payloads, out.completions
            carried = {"carried_samples": float(out.carried_samples)}
            carried["carried_groups"] = float(out.carried_groups)
            stats = {**carried, "partial_done_fraction": out.done_fraction, **extra}
        groups = to_groups(prompts, completions, n, by_index=self._by_index)
        if self.lengths is not None:
            for g in groups:
                self.lengths.observe(g.prompt, (len(c.token_ids) for c in g.completions))
        why = getattr(getattr(self.agent, "last_stats", None), "error", "")
        return RolloutResult(groups, stats, why)

    def _sample(self, prompts, ids, params, n) -> tuple[list[Completion], dict[str, float]]:
        """Completions (episodes, with an agent) and the episodes' ``agent_*`` counts."""
        if self.agent is None:
            return self.engine.generate(ids, params, n=n), {}
        completions = self.agent.generate(ids, params, n=n, prompts=prompts)
        return completions, self.agent.last_stats.metrics()

    def load_weights(self, named_tensors, version: int) -> None:
        """Serve these weights, and stamp ``version`` on every token sampled from now on."""
        self.engine.load_weights(named_tensors, version)

    def load_published(self, root: str, version: int, verify: bool = True) -> None:
        """Load ``version`` from the ``disk`` channel's directory ``root`` (the trainer
        published it there), checking every bucket and tensor checksum."""
        if self._reader is None or self._reader.verify != verify:
            self._reader = Receiver(self.engine, name=f"reader of {root}", verify=verify)
        load_version(root, version, self._reader)

    def join_gloo(self, link, rank: int, verify: bool = True, timeout_s: float = 300.0) -> None:
        """Receive the ``gloo`` channel's versions as ``rank`` of ``link``'s group (a
        :class:`~rlpost.sync.gloo.GlooLink`; the run's weight path is rank 0), in a thread of
        this process, until the sender closes the group. Returns at once: the sender's
        rendezvous waits for this rank. Versions land as ``load_weights`` calls would."""
        from rlpost.sync.gloo import serve_gloo

        def receive() -> None:
            try:
                serve_gloo(self.engine, link, rank, verify=verify, timeout_s=timeout_s)
            except SyncError as exc:  # the sender went away: the engine keeps its last version
                logging.getLogger(__name__).warning("%s", exc)

        threading.Thread(target=receive, name=f"gloo-rank-{rank}", daemon=True).start()

    def weights_served(self, version: int, committed: list[str], failed: list[str]) -> None:
        """The run's weight path put ``version`` on the engine's servers itself (a remote
        engine): ``committed`` serve it now, ``failed`` are behind."""
        self.engine.weights_served(version, committed, failed)

    def version(self) -> int:
        return int(self.engine.version)

    def served_checksum(self) -> int | None:
        """CRC-32 of the weights the engine serves now (None: they live elsewhere, as on a
        remote server, which checks its own with ``sync.verify``)."""
        model = getattr(self.engine, "model", None)
        if model is None:  # the continuous engine serves its scheduler's model
            model = getattr(getattr(self.engine, "scheduler", None), "model", None)
        if not isinstance(model, torch.nn.Module):
            return None
        return weights_checksum(model.named_parameters())

    def throughput(self) -> float:
        return float(self.engine.throughput())

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def state_dict(self) -> dict[str, Any]:
        """The sampling stream, carried groups and length statistics (for checkpoints)."""
        state: dict[str, Any] = {"rng": rng_state()}
        state["engine_generator"] = self.engine.generator.get_state()
        for key in _PARTS:
            if getattr(self, key) is not None:
                state[key] = getattr(self, key).state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "engine_generator" in state:
            self.engine.generator.set_state(state["engine_generator"])
        for key in _PARTS:
            if getattr(self, key) is not None and key in state:
                getattr(self, key).load_state_dict(state[key])
        set_rng_state(state["rng"])

    def close(self) -> None:
        if self.agent is not None and hasattr(self.agent, "close"):
            self.agent.close()  # an agent harness's loopback server
        self.engine.close()
