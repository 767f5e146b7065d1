"""The protocols the loops drive: a trainer, a rollout and a reward worker.

Arguments and results are picklable, so a worker may live in this process, another
(``rlpost.cluster.process``) or a Ray actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.worker import RolloutResult
from rlpost.train.batch import TrainBatch
from rlpost.train.worker import UpdateResult, WeightsExport
from rlpost.types import Group, Prompt


class TrainerAPI(Protocol):
    """Policy, reference and critic: logprobs, values, updates, weights, checkpoints."""

    def describe(self) -> dict[str, Any]: ...
    def version(self) -> int: ...
    def logprobs(self, batch: TrainBatch, which: str = "old") -> torch.Tensor | None: ...
    def values(self, batch: TrainBatch) -> torch.Tensor | None: ...
    def update_critic(self, batch: TrainBatch) -> dict[str, float]: ...
    def update(
        self, batch: TrainBatch, *, beta: float, train_policy: bool = True
    ) -> UpdateResult: ...
    def export_weights(self) -> WeightsExport: ...
    def mfu(self, tokens: float, seq_len: int, seconds: float) -> float: ...
    def scale_lr(self, factor: float) -> float: ...
    def save(self, directory: str | Path) -> None: ...
    def restore(self, directory: str | Path, *, version: int, keep_lr: bool = False) -> int: ...
    def close(self) -> None: ...


class RolloutAPI(Protocol):
    """An engine behind prompts-in, groups-out; weights in with a version."""

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        *,
        train: bool = False,
        last: bool = False,
    ) -> RolloutResult: ...
    def load_weights(self, named_tensors, version: int) -> None: ...
    def version(self) -> int: ...
    def throughput(self) -> float: ...
    def reset_stats(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class RewardAPI(Protocol):
    """Scores group records."""

    def score(
        self, groups: list[Group], max_tokens: int | None = None, *, training: bool = True
    ) -> list[Group]: ...
    def verifiable_accuracy(self, groups: list[Group]) -> float | None: ...
    def counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...


@dataclass
class Workers:
    """The three workers of a run, wherever they live."""

    trainer: TrainerAPI
    rollout: RolloutAPI
    reward: RewardAPI
    teacher: Any = None  # a distillation teacher (rlpost.train.teacher.TeacherAPI), or None

    def close(self) -> None:
        for w in (self.rollout, self.reward, self.trainer):
            w.close()
        if self.teacher is not None:
            self.teacher.close()
