"""Deterministic, resumable batches of prompts.

Each epoch is a permutation drawn from ``seed + epoch``; the cursor
``(epoch, index)`` is all the state there is, so a checkpoint stores two ints
and a resumed run sees exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

import random
from typing import Generic, TypeVar

from rlpost.rng import derive

T = TypeVar("T")


class PromptSampler(Generic[T]):
    def __init__(self, items: list[T], batch_size: int, seed: int = 0) -> None:
        if not items:
            raise ValueError("cannot sample batches from an empty dataset")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(derive(self.seed, "epoch_order", epoch)).shuffle(order)
        return order

    def next_batch(self) -> list[T]:
        out = []
        while len(out) < self.batch_size:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.items[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)
