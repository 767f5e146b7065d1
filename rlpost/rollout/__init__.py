"""Rollout: engines, the OpenAI server, episodes and the rollout worker.

Importing the package registers its engines in ``rlpost.resolved.ENGINES``, each from
its own module (the vLLM and remote modules import their heavy parts only when built).
"""

from rlpost.rollout.engines import continuous, hf, remote, vllm  # noqa: F401
