"""Rewards: verifiable > rule > reward model > LLM judge, mixed and guarded.

Per-sample rewards are plain callables registered by name (``REWARDS``); reward
models and judges are batched scorers (``SCORERS``). ``build_scorer`` turns the
``reward`` config section into one ``RewardScorer``; ``HackingMonitor`` and
``SampleWriter`` watch what the rewards are doing. Untrusted code runs only in
``rlpost.rewards.sandbox``.
"""

from rlpost.rewards.catalog import get_reward
from rlpost.rewards.monitor import HackingMonitor
from rlpost.rewards.registry import REWARDS, SCORERS, batched_scorer, reward_function
from rlpost.rewards.scorer import RewardScorer, SampleWriter, Term, build_scorer

__all__ = [
    "REWARDS",
    "SCORERS",
    "HackingMonitor",
    "RewardScorer",
    "SampleWriter",
    "Term",
    "batched_scorer",
    "build_scorer",
    "get_reward",
    "reward_function",
]
