"""Weight layouts: how the policy's weights are held, scored, exported and checkpointed.

- ``plain``: one module holds the whole weights; the reference is a frozen copy.
- ``lora``: a frozen base with peft adapters; the reference is the base with adapters off,
  engines get the merged weights.
- ``sharded``: FSDP2 shards over the data-parallel ranks, matrices split over the
  tensor-parallel ones (:mod:`rlpost.train.tp`); rank 0 writes the files.

Every layout writes the same checkpoint files, so a run resumes on another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from rlpost.train.dp import (
    DataParallel,
    optimizer_state_by_index,
    optimizer_state_by_name,
)
from rlpost.train.optim import accumulate_grads, micro_slices


def whole_tensors(*, rank0: bool = False):
    """State-dict options: whole tensors on every rank, or (``rank0``) on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=rank0)


class SingleRank:
    """A batch's rows on one worker: the row interface of :class:`DataParallel`, one rank."""

    rank, world = 0, 1

    def micro_slices(self, rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
        return micro_slices(rows, micro_batch_size)

    @staticmethod
    def select(batch, rows: torch.Tensor):
        return batch.select(rows)

    def map_rows(self, batch, fn: Callable) -> torch.Tensor:
        return fn(batch)

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def barrier(self) -> None:
        """Nothing to wait for: one rank."""


class WeightLayout(Protocol):
    """What the trainer and its worker ask of the weights (see the module docstring)."""

    ranks: SingleRank | DataParallel
    writes_files: bool

    @property
    def has_reference(self) -> bool: ...
    def reference(self) -> contextlib.AbstractContextManager[torch.nn.Module]: ...
    def export(self) -> list[tuple[str, torch.Tensor]]: ...
    def save_weights(self, directory: Path, tokenizer) -> None: ...
    def load_weights(self, directory: Path) -> None: ...
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict: ...
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None: ...
    def accumulate(self, micro_batches, micro_loss) -> tuple[float, dict[str, float]]: ...
    def rows_filled(self, t: torch.Tensor) -> torch.Tensor: ...
    def close(self) -> None: ...


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the optimizer's parameters, in its order (the trainable ones, as built)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _load_plain(module: torch.nn.Module, directory: Path) -> None:
    from rlpost.models.loading import load_causal_lm

    module.load_state_dict(load_causal_lm(directory).state_dict())


class PlainLayout:
    """The whole policy in one module; ``ref`` a frozen copy (None: no reference)."""

    writes_files = True

    def __init__(self, model: torch.nn.Module, ref: torch.nn.Module | None = None) -> None:
        self.model, self.ref, self.ranks = model, ref, SingleRank()

    accumulate = staticmethod(accumulate_grads)  # a step's micro-batches, one after another

    def rows_filled(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` whole on every rank, each of its rows filled by the one rank that ran it."""
        return t if self.ranks.world == 1 else self.ranks.sum_tensor(t)

    @property
    def has_reference(self) -> bool:
        return self.ref is not None

    def reference(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        return contextlib.nullcontext(self.ref)

    def export(self) -> list[tuple[str, torch.Tensor]]:
        # .cpu() is the tensor itself on CPU (no copy); a GPU trainer exports CPU copies.
        return [(n, p.detach().cpu()) for n, p in self.model.named_parameters()]

    def save_weights(self, directory: Path, tokenizer) -> None:
        self.model.save_pretrained(directory / "model")
        tokenizer.save_pretrained(directory / "model")
        if self.ref is not None:
            self.ref.save_pretrained(directory / "ref_model")

    def load_weights(self, directory: Path) -> None:
        _load_plain(self.model, directory / "model")
        if self.ref is not None and (directory / "ref_model").is_dir():
            _load_plain(self.ref, directory / "ref_model")

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        # keyed by parameter index (one worker's save) or by name (sharded workers' save)
        optimizer.load_state_dict(optimizer_state_by_index(state, _trainable_names(self.model)))

    def close(self) -> None:
        """Nothing held beyond the modules."""


class LoRALayout(PlainLayout):
    """A peft model whose adapters train; the reference (``keep_reference``) is the base
    with the adapters off."""

    def __init__(self, model: torch.nn.Module, *, keep_reference: bool) -> None:
        super().__init__(model)
        self.keep_reference = keep_reference

    @property
    def has_reference(self) -> bool:
        return self.keep_reference

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        from rlpost.models.lora import reference_mode

        with reference_mode(self.model):
            yield self.model

    def export(self) -> list[tuple[str, torch.Tensor]]:
        """Engines serve plain weights: the adapters folded in, under the base's names."""
        from rlpost.models.lora import merged_weights

        merged = merged_weights(self.model)
        base = self.model.get_base_model()
        # named_parameters lists a tied weight once, as engines expect
        names = [
            n.replace(".base_layer.", ".") for n, _ in base.named_parameters() if "lora_" not in n
        ]
        return [(n, merged[n].cpu()) for n in names]

    def save_weights(self, directory: Path, tokenizer) -> None:
        """``adapter/`` in peft's format (what a resume loads) and ``model/``, the merged
        weights as an ordinary HF checkpoint (what ``model.path`` and engines load)."""
        from rlpost.models.lora import merged_weights, save_adapters

        save_adapters(self.model, directory / "adapter")
        base = self.model.get_base_model()
        with torch.random.fork_rng(devices=[]):  # building it must not move the run's streams
            plain = type(base)(base.config)
        missing, unexpected = plain.load_state_dict(merged_weights(self.model), strict=False)
        if unexpected or [k for k in missing if k in dict(plain.named_parameters())]:
            raise RuntimeError(f"merged LoRA weights do not fit the base model: {missing[:3]}")
        plain.save_pretrained(directory / "model")
        tokenizer.save_pretrained(directory / "model")

    def load_weights(self, directory: Path) -> None:
        from rlpost.models.lora import load_adapters

        if not (directory / "adapter").is_dir():
            raise ValueError(
                f"{directory} holds no adapter/ directory: it was not written by a LoRA run "
                "(model.lora.rank=0 resumes it)"
            )
        load_adapters(self.model, directory / "adapter")


class ShardedLayout:
    """FSDP2 shards (and tensor-parallel slices) of ``model`` and ``ref`` over the ranks
    of ``dp``."""

    def __init__(self, model: torch.nn.Module, ref: torch.nn.Module | None, dp: DataParallel):
        self.model, self.ref, self.ranks = model, ref, dp
        self.writes_files = dp.spec.rank == 0  # the group's first rank, of any mesh axis
        self.names = _trainable_names(model)  # the optimizer's, in one worker's order

    # ``ref`` is sharded as the policy is: held and lent as the plain layout holds its own.
    has_reference = PlainLayout.has_reference
    reference = PlainLayout.reference
    accumulate, rows_filled = staticmethod(accumulate_grads), PlainLayout.rows_filled

    def _whole(self, module: torch.nn.Module, *, state: bool) -> dict[str, torch.Tensor]:
        """``module``'s state (``state``) or parameters, every shard gathered on the
        writing rank (a collective: every rank takes part; the others may get {})."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from rlpost.train.dp import full_tensor, resharded

        if state:
            return get_model_state_dict(resharded(module), options=whole_tensors(rank0=True))
        return {n: full_tensor(p).detach() for n, p in resharded(module).named_parameters()}

    def export(self) -> list[tuple[str, torch.Tensor]]:
        whole = self._whole(self.model, state=False)
        if not self.writes_files:  # the group returns rank 0's; the others send nothing back
            return []
        return [(n, t.cpu()) for n, t in whole.items()]

    def save_weights(self, directory: Path, tokenizer) -> None:
        """The same files as one worker's save, rank 0 writing what was gathered to it."""
        for module, sub in [(self.model, "model"), (self.ref, "ref_model")]:
            if module is not None:
                state = self._whole(module, state=True)
                if self.writes_files:
                    _save_plain(module, state, directory / sub)
        if self.writes_files:
            tokenizer.save_pretrained(directory / "model")

    def load_weights(self, directory: Path) -> None:
        """Every rank reads the whole checkpoint and keeps its shards (of what it holds)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        from rlpost.models.loading import load_causal_lm
        from rlpost.train.dp import resharded

        for module, sub in [(self.model, "model"), (self.ref, "ref_model")]:
            if module is None or not (directory / sub).is_dir():
                continue
            mine, whole = resharded(module).state_dict(), load_causal_lm(directory / sub)
            mine = {k: v for k, v in whole.state_dict().items() if k in mine}
            set_model_state_dict(module, mine, options=whole_tensors())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole state keyed by parameter name (a collective), so a checkpoint
        resumes on any number of workers."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, optimizer, options=whole_tensors(rank0=True))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """This rank's share of a whole state (keyed by name, or by one worker's index)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        keep = set(_trainable_names(self.model))
        by_name = optimizer_state_by_name(state, self.names)
        mine = {
            "state": {n: v for n, v in by_name["state"].items() if n in keep},
            "param_groups": [
                {**g, "params": [n for n in g["params"] if n in keep]}
                for g in by_name["param_groups"]
            ],
        }
        set_optimizer_state_dict(self.model, optimizer, mine, options=whole_tensors())

    def close(self) -> None:
        """Leave the data-parallel group."""
        from rlpost.train.dp import destroy_group

        destroy_group()


def _save_plain(model: torch.nn.Module, state: dict[str, torch.Tensor], out: Path) -> None:
    """``state`` saved as an ordinary HF directory of ``model``'s class (sharded modules
    cannot ``save_pretrained`` themselves)."""
    from torch.distributed.fsdp import FSDPModule

    # fully_shard swaps the class for an FSDP subclass; build the model's own class
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.random.fork_rng(devices=[]):  # building it must not move the run's streams
        plain = cls(model.config)
    plain.load_state_dict(state)
    plain.save_pretrained(out)
