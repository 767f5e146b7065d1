"""A mixture of prompt sources and the sampler that draws batches from it by weight.

``data.sources`` lists sources, each a file (JSONL, Parquet or a ``datasets``
save_to_disk directory), a built-in task or a reasoning-gym task, with its own
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

import random
from dataclasses import dataclass, replace

from rlpost.config import SourceConfig
from rlpost.data.arith import arith_splits
from rlpost.data.code import code_splits
from rlpost.data.files import DataError, LoadReport, load_prompt_file, prompt_file_keywords
from rlpost.data.sampler import PromptSampler
from rlpost.rng import derive
from rlpost.types import Prompt


@dataclass
class LoadedSource:
    """One source's rows (not yet rendered for the model) and their load reports."""

    name: str
    train: list[Prompt]
    held_out: list[Prompt]
    train_report: LoadReport
    eval_report: LoadReport
    system_prompt: str | None = None  # the rows' own system message (a verifiers environment's)


def load_source(src: SourceConfig, *, on_bad_row: str) -> LoadedSource:
    """Rows of one source, each tagged with its name; raises DataError or ValueError in one
    line naming the source."""
    train_report, eval_report = LoadReport(), LoadReport()
    where = f"data.sources[{src.name}]"
    system = None
    if src.task in ("arith", "code"):
        try:
            train, held_out = builtin_splits(src)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif src.task == "reasoning_gym":
        from rlpost.data.reasoning_gym import generate_splits  # lazy: an optional extra

        train, held_out, info = generate_splits(src.reasoning_gym, src.prompt_template)
        train_report.info = info
    elif src.task == "verifiers":
        train, held_out, system = _verifiers_rows(src, where)
    else:
        kwargs = prompt_file_keywords(src, on_bad_row)
        train = []  # a streamed source's rows are read as the run draws them (data/stream.py)
        if not src.stream:
            train, train_report = load_prompt_file(src.train_path, **kwargs)
        held_out = []
        if src.eval_path:
            held_out, eval_report = load_prompt_file(src.eval_path, **kwargs)
    if src.task != "file":  # generated rows: every one is used
        train_report.rows, eval_report.rows = len(train), len(held_out)
    train = [_tag(p, src.name) for p in train]
    held_out = [_tag(p, src.name) for p in held_out]
    return LoadedSource(src.name, train, held_out, train_report, eval_report, system)


def builtin_splits(section) -> tuple[list[Prompt], list[Prompt]]:
    """The train and held-out prompts of a built-in task (``task`` arith or code) of a data
    section or a source, each through its ``prompt_template``; ValueError on bad sizes."""
    a, c = section.arith, section.code
    train, held_out = (
        arith_splits(a.max_operand, a.ops, a.train_size, a.eval_size)
        if section.task == "arith"
        else code_splits(c.train_size, c.eval_size)
    )
    for p in train + held_out:
        p.text = section.prompt_template.format(prompt=p.text)
    return train, held_out


def _verifiers_rows(src: SourceConfig, where: str) -> tuple[list[Prompt], list[Prompt], str | None]:
    from rlpost.data.verifiers_source import env_splits  # lazy: an optional extra

    try:
        train, held_out, system, _ = env_splits(src.verifiers)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    for p in train + held_out:
        p.text = src.prompt_template.format(prompt=p.text)
    return train, held_out, system


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
    one they hold.
    """

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
