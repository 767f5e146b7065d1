"""The trainer worker: everything that holds training state, behind a narrow interface.

The policy, its optimizer and LR schedule, the frozen reference policy, the
critic and the shuffle generators live here and nowhere else. The pipeline
calls the methods below with picklable values (a :class:`TrainBatch` of
tensors, floats, paths) and gets picklable values back, never a module, an
optimizer or a generator. That is what lets ``rlpost.cluster`` put this worker
in the training process, in a process of its own, or in a Ray actor without
the loop changing.

The worker owns the weights' **version**: 0 for the starting policy, one more
after every :meth:`update`, and the checkpoint's step after :meth:`restore`.
Engines stamp it on every token they sample.

Data parallel (``dp``): N workers, one per rank, each get the same calls; each
runs its share of the rows and all return the same result (logprobs gathered,
weights and checkpoints whole), so a driver may keep rank 0's. Rank 0 alone writes
checkpoint files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlpost.rng import rng_state, set_rng_state
from rlpost.train.actor import PolicyTrainer, PolicyUpdate
from rlpost.train.batch import TrainBatch

STATE_FILE = "trainer_state.pt"


@dataclass
class UpdateResult:
    """What one policy update reports.

    ``stats``: means over the optimizer steps (``loss``, ``pg_loss``, ``grad_norm``,
    ``clip_frac``, ``lr``...; empty when the policy did not train). ``old_logprobs``:
    ``[B, T]`` when the update computed them from its own loss pass (one optimizer
    step per batch), else None. ``version``: the weights' version after the update.
    """

    stats: dict[str, float]
    old_logprobs: torch.Tensor | None
    version: int


@dataclass
class WeightsExport:
    """The policy's weights as ``(name, tensor)`` pairs in ``named_parameters`` order."""

    version: int
    tensors: list[tuple[str, torch.Tensor]]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


class TrainerWorker:
    """Actor (policy trainer), reference policy and optional critic of one run."""

    def __init__(
        self,
        trainer: PolicyTrainer,
        tokenizer,
        *,
        critic=None,
        version: int = 0,
        lora=False,
        dp=None,
    ) -> None:
        self.trainer = trainer
        self.dp = dp  # rlpost.train.dp.DataParallel, shared with the trainer
        self.tokenizer = tokenizer
        self.critic = critic
        self._version = version
        self.lora = lora  # the policy carries peft adapters (rlpost.models.lora)

    # ------------------------------------------------------------- queries

    def describe(self) -> dict[str, Any]:
        """Facts the loop needs once: pad id, whether a critic / reference exist."""
        return {
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
            "has_critic": self.critic is not None,
            "has_reference": self.trainer.has_reference,
            "version": self._version,
        }

    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------ logprobs

    def logprobs(self, batch: TrainBatch, which: str = "old") -> torch.Tensor | None:
        """``[B, T]`` logprobs of the batch's responses under the current policy (``old``)
        or the reference (``ref``; None when no reference is kept); ``sum_pi_squared``:
        the current policy's ``sum_v pi(v)^2`` at each response position (the optimal
        token baseline's input, from the same forward pass as ``old``)."""
        if which == "old":
            return self.trainer.old_logprobs(batch)
        if which == "ref":
            return self.trainer.ref_logprobs(batch)
        if which == "sum_pi_squared":
            return self.trainer.sum_pi_squared(batch)
        raise ValueError(f"logprobs(which={which!r}): use 'old', 'ref' or 'sum_pi_squared'")

    def values(self, batch: TrainBatch) -> torch.Tensor | None:
        """``[B, T]`` critic values (None without a critic)."""
        return None if self.critic is None else self.critic.values(batch)

    # ------------------------------------------------------------- updates

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return {} if self.critic is None else self.critic.update(batch)

    def update(self, batch: TrainBatch, *, beta: float, train_policy: bool = True) -> UpdateResult:
        """One trainer step: optimizer steps on the policy (unless ``train_policy`` is False,
        during critic warm-up), then the version moves on."""
        done = self.trainer.update(batch, beta=beta) if train_policy else PolicyUpdate({})
        self._version += 1
        return UpdateResult(stats=done.stats, old_logprobs=done.old_logprobs, version=self._version)

    def export_weights(self) -> WeightsExport:
        """The policy's current weights on CPU, tagged with their version (no copy in this
        process when the trainer is on CPU)."""
        if self.lora:  # engines serve plain weights: the adapters folded in, base names
            from rlpost.models.lora import merged_weights

            merged = merged_weights(self.trainer.model)
            base = self.trainer.model.get_base_model()
            # named_parameters lists a tied weight once, as engines expect
            names = [
                n.replace(".base_layer.", ".")
                for n, _ in base.named_parameters()
                if "lora_" not in n
            ]
            return WeightsExport(self._version, [(n, merged[n].cpu()) for n in names])
        if self.dp is not None:
            from rlpost.train.dp import full_parameters

            whole = full_parameters(self.trainer.model)  # a collective: every rank takes part
            if self.dp.rank != 0:  # the group returns rank 0's; the others send nothing back
                return WeightsExport(self._version, [])
            return WeightsExport(self._version, [(n, t.cpu()) for n, t in whole])
        # .cpu() is the tensor itself on CPU (no copy); a GPU trainer exports CPU copies.
        tensors = [(n, p.detach().cpu()) for n, p in self.trainer.model.named_parameters()]
        return WeightsExport(self._version, tensors)

    def mfu(self, tokens: float, seq_len: int, seconds: float) -> float:
        return self.trainer.mfu_of(tokens, seq_len, seconds)

    def scale_lr(self, factor: float) -> float:
        return self.trainer.scale_lr(factor)

    # --------------------------------------------------------- checkpoints

    def save(self, directory: str | Path) -> None:
        """Write the policy (an HF directory with the tokenizer), the reference and the
        optimizer / scheduler / generator / critic state into ``directory``."""
        d = Path(directory)
        if self.dp is not None:
            self._save_sharded(d)
            return
        if self.lora:
            self._save_lora(d)
        else:
            self.trainer.model.save_pretrained(d / "model")
        self.tokenizer.save_pretrained(d / "model")
        if self.trainer.ref_model is not None:
            self.trainer.ref_model.save_pretrained(d / "ref_model")
        state = {"trainer": self.trainer.state_dict(), "rng": rng_state()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        torch.save(state, d / STATE_FILE)

    def restore(self, directory: str | Path, *, version: int, keep_lr: bool = False) -> int:
        """Load what :meth:`save` wrote; the weights' version becomes ``version``.

        ``keep_lr``: keep the LR reductions made since the checkpoint (a guard's rollback).
        """
        from rlpost.models.loading import load_causal_lm

        d = Path(directory)
        base_lrs = list(self.trainer.scheduler.base_lrs)
        if self.dp is not None:
            self._restore_sharded(d)
        else:
            if self.lora:
                from rlpost.models.lora import load_adapters

                load_adapters(self.trainer.model, d / "adapter")
            else:
                self.trainer.model.load_state_dict(load_causal_lm(d / "model").state_dict())
            ref = self.trainer.ref_model
            if ref is not None and (d / "ref_model").is_dir():
                ref.load_state_dict(load_causal_lm(d / "ref_model").state_dict())
        # weights_only=False: the state holds RNG tuples and numpy arrays we wrote ourselves.
        # map_location: optimizer.load_state_dict moves the state onto its parameters' device.
        state = torch.load(d / STATE_FILE, weights_only=False, map_location="cpu")
        # A checkpoint resumes on any number of workers: the optimizer state is keyed by
        # parameter index (one worker's save) or by name (data-parallel workers' save).
        from rlpost.train.dp import optimizer_state_by_index, optimizer_state_by_name

        names = self._optimized_names()
        if self.dp is not None:
            self._load_sharded_optimizer(
                optimizer_state_by_name(state["trainer"]["optimizer"], names)
            )
            state["trainer"]["optimizer"] = self.trainer.optimizer.state_dict()
        else:
            state["trainer"]["optimizer"] = optimizer_state_by_index(
                state["trainer"]["optimizer"], names
            )
        self.trainer.load_state_dict(state["trainer"])
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
        set_rng_state(state["rng"])
        if keep_lr:  # the optimizer's LR came from the checkpoint: the cuts apply now too
            self.trainer.set_base_lrs(base_lrs)
        self._version = version
        return version

    def _save_lora(self, d: Path) -> None:
        """``adapter/`` in peft's format (what a resume loads) and ``model/``, the merged
        weights as an ordinary HF checkpoint (what ``model.path`` and engines load)."""
        from rlpost.models.lora import merged_weights, save_adapters

        model = self.trainer.model
        save_adapters(model, d / "adapter")
        base = model.get_base_model()
        with torch.random.fork_rng(devices=[]):  # building it must not move the run's streams
            plain = type(base)(base.config)
        missing, unexpected = plain.load_state_dict(merged_weights(model), strict=False)
        if unexpected or [k for k in missing if k in dict(plain.named_parameters())]:
            raise RuntimeError(f"merged LoRA weights do not fit the base model: {missing[:3]}")
        plain.save_pretrained(d / "model")

    # ------------------------------------------------- sharded checkpoints

    def _save_sharded(self, d: Path) -> None:
        """The same files as one worker's save: every shard gathered, rank 0 writes.

        The optimizer state is saved whole, keyed by parameter name, so a checkpoint
        resumes on any number of workers."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from rlpost.train.dp import resharded

        # gathered into rank 0's memory only (the others take part and keep nothing)
        to_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, ref = resharded(self.trainer.model), self.trainer.ref_model
        policy = get_model_state_dict(model, options=to_rank0)
        ref_state = None
        if ref is not None:
            ref_state = get_model_state_dict(resharded(ref), options=to_rank0)
        optim = get_optimizer_state_dict(model, self.trainer.optimizer, options=to_rank0)
        if self.dp.rank == 0:
            _save_plain(model, policy, d / "model")
            self.tokenizer.save_pretrained(d / "model")
            if ref_state is not None:
                _save_plain(ref, ref_state, d / "ref_model")
            trainer_state = self.trainer.state_dict() | {"optimizer": optim}
            torch.save({"trainer": trainer_state, "rng": rng_state()}, d / STATE_FILE)
        self.dp.barrier()  # no rank returns before the files are there

    def _restore_sharded(self, d: Path) -> None:
        """Every rank reads the whole checkpoint and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from rlpost.models.loading import load_causal_lm
        from rlpost.train.dp import resharded

        whole = StateDictOptions(full_state_dict=True)
        model = resharded(self.trainer.model)
        set_model_state_dict(model, load_causal_lm(d / "model").state_dict(), options=whole)
        ref = self.trainer.ref_model
        if ref is not None and (d / "ref_model").is_dir():
            ref = resharded(ref)
            set_model_state_dict(ref, load_causal_lm(d / "ref_model").state_dict(), options=whole)

    def _optimized_names(self) -> list[str]:
        """Names of the optimizer's parameters, in its order (trainable ones, as built)."""
        return [n for n, p in self.trainer.model.named_parameters() if p.requires_grad]

    def _load_sharded_optimizer(self, optim_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self.trainer.model,
            self.trainer.optimizer,
            optim_state,
            options=StateDictOptions(full_state_dict=True),
        )

    def close(self) -> None:
        """Leave the data-parallel group, if any (nothing else to release in process)."""
        if self.dp is not None:
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
