"""Typed records passed between stages (DESIGN.md "one training step, as data").

Token-level tensors between layers are right-padded ``[B, T]`` with a
``response_mask``; ``group`` is an int64 ``[B]`` mapping each row to its prompt.
Records here are plain dataclasses so every stage can be run and inspected on
its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Turn:
    """One turn of a multi-turn episode: response tokens ``start .. end - 1``.

    ``role`` is ``"policy"`` (sampled, trained) or ``"env"`` (the environment's
    answer, masked from the loss). A policy turn carries the tool it called
    (``None``: it answered, or its call was past the turn budget and never ran), the
    reward the environment gave it, whether the call failed and its wall time in
    ``seconds``.
    ``text`` is the turn's tokens decoded (for people reading samples; never re-encoded).
    """

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
    """How a multi-turn completion unfolded.

    ``answer`` is the text of the policy's last turn: what the reward terms
    judge. ``budget`` names the budget that ended the episode (``"turns"`` or
    ``"tokens"``), ``None`` when the policy or the environment ended it.
    """

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
    """One task instance: the text shown to the policy and what the reward needs.

    ``answer`` is the reference (a number, a string, a list of tests...);
    ``metadata`` carries anything else a reward function may read (task name,
    test cases, rubric). ``uid`` identifies the prompt across steps (length
    prediction, partial rollout, sample logs).
    """

    text: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    uid: str = ""
    source: str = ""  # the data.sources entry it came from ("": a one-source config)


@dataclass
class Completion:
    """One sampled response, as the rollout engine produced it.

    ``logprobs[i]`` is the engine's log-probability of ``token_ids[i]`` under the
    sampling distribution actually used (temperature applied, before top-p/top-k
    truncation renormalisation is *not* applied: it is the model's tempered
    distribution). ``loss_mask[i]`` is 0 for tokens the policy did not produce
    (tool output in a multi-turn rollout) and 1 otherwise. ``token_versions[i]``
    is the policy version of the weights that sampled ``token_ids[i]`` (a sample
    continued across a weight update spans several); ``policy_version`` is the
    version that began the sample. ``group`` is the engine's prompt index within
    one ``generate`` call; the pipeline groups samples in :class:`Group` records.
    """

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

    The group size travels here and only here (``len(completions)``). The reward
    worker fills ``scores`` (the final scalar reward of each sample, what trains),
    ``components`` (each reward term's value per sample, ``nan`` where it did not
    apply) and ``invalid`` (True where the reward was NaN, infinite or out of
    range: the score is then ``reward.invalid_score`` and the sample's tokens are
    not trained). Per-token logprobs, versions, finish reasons and loss masks are
    in the completions, so a multi-turn episode (tool output masked) fits as is.
    """

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
    """The canonical sample every reward function scores.

    Reward functions are plain callables ``fn(sample, **params) -> float | None``;
    ``None`` means "not applicable to this sample" (e.g. a code reward on a math
    prompt) and is distinct from a score of 0.
    """

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
    """Scores for a batch of completions plus each named component for logging.

    ``scores[i]`` is the final scalar reward of completion i (finite floats only;
    invalid scores are replaced and counted in ``invalid``; their indices are in
    ``invalid_rows`` so the trainer can drop them). ``components`` maps a reward
    name to its per-sample values (``nan`` where not applicable).
    """

    scores: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    invalid: int = 0
    invalid_rows: list[int] = field(default_factory=list)
