"""The trainer worker: everything that holds training state, behind a narrow interface.

The policy, optimizer, schedule, reference, critic and shuffle generators live here alone;
calls take and return picklable values only, so ``rlpost.cluster`` can place the worker in
process, in a process of its own or in a Ray actor. The worker owns the weights' version: 0 at
start, one more per :meth:`update`. Data-parallel ranks get the same calls and return the same
results; rank 0 alone writes checkpoint files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlpost.observe.memory import release_free_heap
from rlpost.rng import rng_state, set_rng_state
from rlpost.statefile import load_state, save_state
from rlpost.train.actor import PolicyTrainer, PolicyUpdate
from rlpost.train.batch import TrainBatch
from rlpost.train.dp import held_numel
from rlpost.train.layout import WeightLayout

STATE_FILE = "trainer_state.pt"


@dataclass
class UpdateResult:
    """What one policy update reports; ``old_logprobs`` ``[B, T]`` when its loss pass made
    them."""

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
    """Actor, reference and optional critic of one run; ``layout`` (:mod:`rlpost.train.layout`)
    holds, exports and checkpoints the weights."""

    def __init__(
        self,
        trainer: PolicyTrainer,
        tokenizer,
        *,
        layout: WeightLayout,
        critic=None,
        version: int = 0,
    ) -> None:
        self.trainer = trainer
        self.layout = layout
        self.tokenizer = tokenizer
        self.critic = critic
        self._version = version
        self._held = held_numel(trainer.model)  # as built: sharded, before any forward

    def describe(self) -> dict[str, Any]:
        """Facts the loop needs once: pad id, critic and reference, the parameter elements
        this rank holds and the passes' ``packing``."""
        return {
            "parameters_held": self._held,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
            "has_critic": self.critic is not None,
            "has_reference": self.layout.has_reference,
            "version": self._version,
            "packing": self.trainer.packed.name.lower(),
        }

    def version(self) -> int:
        return self._version

    def logprobs(self, batch: TrainBatch, which: str = "old") -> torch.Tensor | None:
        """``[B, T]`` logprobs under the policy (``old``) or the reference (``ref``; None
        without one); ``sum_pi_squared``: ``sum_v pi(v)^2`` from the same pass."""
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

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return {} if self.critic is None else self.critic.update(batch)

    def update(self, batch: TrainBatch, *, beta: float, train_policy: bool = True) -> UpdateResult:
        """One trainer step: optimizer steps on the policy (unless ``train_policy`` is False,
        during critic warm-up), then the version moves on. ``batch`` is left as it came."""
        done = self.trainer.update(batch, beta=beta) if train_policy else PolicyUpdate({})
        self._version += 1
        release_free_heap()  # what the step freed, back to the system, in every backend
        return UpdateResult(stats=done.stats, old_logprobs=done.old_logprobs, version=self._version)

    def export_weights(self) -> WeightsExport:
        """The policy's current weights on CPU, tagged with their version (no copy in this
        process when the trainer is on CPU; LoRA's merged, a sharded policy's gathered)."""
        return WeightsExport(self._version, self.layout.export())

    def mfu(self, tokens: float, seq_len: int, seconds: float) -> float:
        return self.trainer.mfu_of(tokens, seq_len, seconds)

    def scale_lr(self, factor: float) -> float:
        return self.trainer.scale_lr(factor)

    def save(self, directory: str | Path) -> None:
        """Write the policy (an HF directory with the tokenizer), the reference and the
        optimizer / scheduler / LR scale / generator / critic state into ``directory``."""
        d = Path(directory)
        self.layout.save_weights(d, self.tokenizer)
        state = {"trainer": self.trainer.state_dict(), "rng": rng_state()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.layout.writes_files:
            save_state(state, d / STATE_FILE)
        self.layout.ranks.barrier()  # no rank returns before the files are there

    def restore(self, directory: str | Path, *, version: int, keep_lr: bool = False) -> int:
        """Load what :meth:`save` wrote as ``version``; ``keep_lr`` keeps later LR cuts."""
        d = Path(directory)
        self.layout.load_weights(d)
        # on the CPU: optimizer.load_state_dict moves the state onto its parameters' device
        state = load_state(d / STATE_FILE)
        self.trainer.load_state_dict(state["trainer"], keep_lr_scale=keep_lr)
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
        set_rng_state(state["rng"])
        self._version = version
        return version

    def close(self) -> None:
        """Leave the data-parallel group, if any (nothing else to release in process)."""
        self.layout.close()
