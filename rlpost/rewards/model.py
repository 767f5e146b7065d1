"""Reward model: a sequence-classification model with one output scores a response.

Registered as the batched scorer ``reward_model`` (``path``: a local HF directory). Batches
are formed by token length; scores come back in the caller's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlpost.rewards.registry import batched_scorer
from rlpost.types import RewardSample


@batched_scorer("reward_model")
class RewardModelWorker:
    """Scores with an ``AutoModelForSequenceClassification`` whose one logit is the reward."""

    default_kind = "model"

    def __init__(
        self, path: str, batch_size: int = 8, device: str = "cpu", max_length: int = 2048
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"reward_model: batch_size must be >= 1, got {batch_size}")
        if not Path(path).is_dir():
            raise ValueError(f"reward_model: path {path!r} is not a local model directory")
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path)
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward_model: {path} has num_labels={self.model.config.num_labels}; need 1"
            )
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"reward_model: tokenizer at {path} has no pad or eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the logit is read at the last non-pad token, found through config.pad_token_id
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length

    def score(self, samples: Sequence[RewardSample]) -> list[float]:
        """One float per sample, in order. Inputs: right-padded ``[b, T]`` batches."""
        import torch

        if not samples:
            return []
        pairs = [(s.prompt, s.completion) for s in samples]
        encoded = reward_input_ids(self.tokenizer, pairs, max_length=self.max_length)
        order = sorted(range(len(samples)), key=lambda i: len(encoded[i]))
        scores: list[float] = [0.0] * len(samples)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            batch = self.tokenizer.pad(
                {"input_ids": [encoded[i] for i in rows]}, padding=True, return_tensors="pt"
            )
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with torch.inference_mode():
                logits = self.model(**batch).logits[:, 0].float().cpu()
            for i, value in zip(rows, logits.tolist(), strict=True):
                scores[i] = value
        return scores

    def close(self) -> None:
        """Drop the weights (the worker is unusable afterwards)."""
        self.model = None  # type: ignore[assignment]


def reward_input_ids(
    tokenizer, pairs: Sequence[tuple[str, str]], *, max_length: int | None = None
) -> list[list[int]]:
    """The token ids a reward model reads for each (prompt, response): with a chat template
    a user / assistant exchange, otherwise ``prompt + response``; cut to ``max_length``. Shared
    by scoring and ``rlpost rm``."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    if templated:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                tokenize=False,
            )
            for p, r in pairs
        ]
    else:
        texts = [p + r for p, r in pairs]
    encoded = tokenizer(
        texts,
        truncation=max_length is not None,
        max_length=max_length,
        # the chat template already wrote the special tokens (BOS): not twice
        add_special_tokens=not templated,
    )["input_ids"]
    # An empty text has no last token to read the score from; give it one.
    filler = tokenizer.eos_token_id or tokenizer.pad_token_id
    return [ids if ids else [filler] for ids in encoded]
