"""A mixture of prompt sources and the sampler that draws batches from it by weight.

``data.sources`` lists sources, each a task (a file: JSONL, Parquet or a ``datasets``
save_to_disk directory; a built-in task; a reasoning-gym task; a verifiers dataset)
loaded by the loader registered under its name (rlpost.data.tasks), with its own
weight, prompt template, system prompt and reward terms. Every prompt carries its
source's name (``Prompt.source``), which is how rewards are routed and metrics
labelled; its uid is prefixed with the name, so two sources' rows never share one.

The design choice: every slot of a batch picks its source independently, with
probability proportional to the weights, from a generator seeded by the run seed
and the batch's number; inside a source, rows come in that source's own seeded
permutation, epoch after epoch (:class:`~rlpost.data.sampler.PromptSampler`). The
state is the number of batches drawn and each source's cursor, so a checkpoint
stores a few ints and a resumed run draws exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace

from rlpost.config import FileTaskConfig, SourceConfig
from rlpost.data import arith, code, reasoning_gym, verifiers_source  # noqa: F401 (their tasks)
from rlpost.data.files import DataError, load_prompt_file, prompt_file_keywords, split_off
from rlpost.data.sampler import PromptSampler
from rlpost.data.tasks import TASKS, Splits
from rlpost.rng import derive
from rlpost.types import Prompt

log = logging.getLogger(__name__)


def load_source(src: SourceConfig, *, on_bad_row: str) -> Splits:
    """Rows of one source from its task's loader, each tagged with the source's name (an
    unnamed source, ``data.task`` alone, leaves them as they are); ValueError for a bad
    setting, DataError for bad rows."""
    got = TASKS.get(src.task.name)(src.task, template=src.prompt_template, on_bad_row=on_bad_row)
    if src.name:
        got.train = [_tag(p, src.name) for p in got.train]
        got.held_out = [_tag(p, src.name) for p in got.held_out]
    return got


@TASKS.register("file")
def load_files(t: FileTaskConfig, *, template: str, on_bad_row: str) -> Splits:
    """A file task's rows: train_path (unless streamed: data/stream.py reads it as the run
    draws) and eval_path, each when set."""
    kwargs = prompt_file_keywords(t, on_bad_row, template)
    out = Splits([], [])
    if t.train_path and not t.stream:
        out.train, out.train_report = load_prompt_file(t.train_path, **kwargs)
    if t.eval_path:
        out.held_out, out.eval_report = load_prompt_file(t.eval_path, **kwargs)
    elif len(out.train) > 1:  # no held-out file: a seeded share of the train rows
        out.train, out.held_out = split_off(out.train, t.eval_fraction, seed=0)
    elif t.train_path:
        why = "is streamed" if t.stream else "has one row"
        log.warning("data.task.eval_path is unset and train_path %s: no row is held out", why)
    return out


def _tag(p: Prompt, name: str) -> Prompt:
    return replace(p, source=name, uid=f"{name}/{p.uid}")


def by_source(prompts: list[Prompt]) -> dict[str, list[Prompt]]:
    """``prompts`` grouped by their source, each group in its original order."""
    out: dict[str, list[Prompt]] = {}
    for p in prompts:
        out.setdefault(p.source, []).append(p)
    return out


class MixtureSampler:
    """Batches of ``batch_size`` prompts, each slot's source drawn by weight.

    Same interface as :class:`PromptSampler` (``next_batch``, ``state_dict``,
    ``load_state_dict``), so the loop, the feeds and the checkpoint need not know which
    one they hold."""

    def __init__(
        self,
        prompts: dict[str, list[Prompt]],
        weights: dict[str, float],
        batch_size: int,
        seed: int = 0,
        streams: dict | None = None,
    ) -> None:
        streams = streams or {}
        empty = [name for name in weights if not prompts.get(name) and name not in streams]
        if empty:
            raise DataError(f"data.sources[{empty[0]}] has no training rows to sample")
        self.names = list(weights)
        self.weights = [weights[n] for n in self.names]
        self.batch_size = batch_size
        self.seed = seed
        self.batches = 0
        # Each source its own permutation stream, so adding a source leaves another's order.
        # A streamed source (data/stream.py) is made here from its seed the same way; its rows
        # in ``prompts`` (the start's check of its first rows) only feed the warm-up.
        self.samplers = {
            n: streams[n](seed=derive(seed, "source", i))
            if n in streams
            else PromptSampler(prompts[n], 1, seed=derive(seed, "source", i))
            for i, n in enumerate(self.names)
        }

    def sources_of(self, batch: int) -> list[str]:
        """The source of each slot of batch number ``batch`` (a pure function of it)."""
        rng = random.Random(derive(self.seed, "source_pick", batch))
        return rng.choices(self.names, weights=self.weights, k=self.batch_size)

    def next_batch(self) -> list[Prompt]:
        picks = self.sources_of(self.batches)
        self.batches += 1
        return [self.samplers[n].next_batch()[0] for n in picks]

    def state_dict(self) -> dict:
        return {
            "batches": self.batches,
            "sources": {n: s.state_dict() for n, s in self.samplers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self.samplers) - set(state.get("sources", {})))
        if "batches" not in state or missing:
            raise DataError(
                "the checkpoint's data state was saved with other data.sources "
                f"(no cursor for {missing or 'the mixture'}); resume with the run's own config"
            )
        self.batches = int(state["batches"])
        for n, s in self.samplers.items():
            s.load_state_dict(state["sources"][n])


def make_sampler(
    prompts: list[Prompt],
    sources: list[SourceConfig],
    batch_size: int,
    seed: int,
    streams: dict | None = None,
) -> PromptSampler | MixtureSampler:
    """The run's sampler: one permutation of ``prompts`` without sources (the one-source
    order, unchanged), else the weighted mixture over them. ``streams``: each streamed
    source's sampler, made from its seed (``streams[name](seed=...)``)."""
    if not sources:
        return PromptSampler(prompts, batch_size, seed=seed)
    weights = {s.name: s.weight for s in sources}
    return MixtureSampler(by_source(prompts), weights, batch_size, seed=seed, streams=streams)
