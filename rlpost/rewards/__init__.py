"""Rewards: verifiable > rule > reward model > LLM judge, mixed and guarded.

Per-sample callables (``REWARDS``) and batched scorers (``SCORERS``); ``build_scorer`` makes
the ``reward`` section one ``RewardScorer``.
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
