"""Typed records passed between stages (DESIGN.md "one training step, as data").

Token-level tensors are right-padded ``[B, T]`` with a ``response_mask``; ``group`` is an
int64 ``[B]`` mapping each row to its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Turn:
    """One turn of a multi-turn episode: response tokens ``start .. end - 1``; ``role``:
    ``"policy"`` (trained) or ``"env"`` (masked); ``text`` is for reading, never re-encoded."""

    role: Literal["policy", "env"]
    start: int
    end: int
    tool: str | None = None
    text: str = ""
    reward: float = 0.0
    error: bool = False
    seconds: float = 0.0
    arguments: str | None = None  # the call's argument text, as the environment got it


@dataclass
class Episode:
    """How a multi-turn completion unfolded; ``answer`` is the last policy turn, ``budget``
    the budget that ended it, if one did."""

    turns: list[Turn] = field(default_factory=list)
    answer: str = ""
    budget: str | None = None

    @property
    def tool_calls(self) -> int:
        return sum(1 for t in self.turns if t.role == "policy" and t.tool is not None)

    @property
    def policy_turns(self) -> int:
        return sum(1 for t in self.turns if t.role == "policy")


@dataclass
class Prompt:
    """One task instance: the text shown to the policy and what the reward needs."""

    text: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    uid: str = ""
    source: str = ""  # the data.sources entry it came from ("": a one-source config)


@dataclass
class Completion:
    """One sampled response, as the rollout engine produced it.

    ``logprobs[i]``: of ``token_ids[i]`` under the tempered, untruncated distribution.
    ``loss_mask[i]``: 0 for tokens the policy did not produce. ``token_versions[i]``: the
    policy version that sampled ``token_ids[i]``; ``policy_version``: the one that began.
    ``group``: the prompt index within one ``generate`` call."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    group: int
    text: str = ""
    loss_mask: list[int] | None = None
    token_versions: list[int] | None = None
    episode: Episode | None = None  # the turns of a multi-turn episode (None: one turn)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def versions_per_token(self) -> list[int]:
        """The version of every token (``policy_version`` for each when the engine gave none)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.policy_version] * len(self.token_ids)


@dataclass
class Group:
    """One prompt and its ``n`` samples: the record the rollout stage hands to training.

    The group size travels here only. ``invalid``: a NaN, infinite or out-of-range reward,
    scored ``reward.invalid_score`` and not trained."""

    prompt: Prompt
    completions: list[Completion]
    scores: list[float] | None = None
    components: dict[str, list[float]] = field(default_factory=dict)
    invalid: list[bool] | None = None
    baseline_score: float | None = None  # reward of a greedy answer to the prompt (ReMax)

    @property
    def n(self) -> int:
        return len(self.completions)

    @property
    def scored(self) -> bool:
        return self.scores is not None


@dataclass
class RewardSample:
    """What every reward ``fn(sample, **params) -> float | None`` scores (None: not
    applicable, distinct from 0)."""

    prompt: str
    completion: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    finish_reason: FinishReason = "stop"
    num_tokens: int = 0
    max_tokens: int = 0
    source: str = ""  # the prompt's data source: which source's reward terms score it
    episode: Episode | None = None  # a multi-turn completion's turns (rewards that read them)


@dataclass
class ScoredBatch:
    """Finite scores of a batch (invalid ones replaced and indexed in ``invalid_rows``) and
    each term's values, ``nan`` where not applicable."""

    scores: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    invalid: int = 0
    invalid_rows: list[int] = field(default_factory=list)
