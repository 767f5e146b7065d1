"""The RL loop and its builders; importing it registers the rollout engines the run facts read."""

import rlpost.rollout  # noqa: F401
