"""Rollout: engines, the OpenAI server, episodes and the rollout worker.

Importing the package registers its engines in ``rlpost.resolved.ENGINES``, each from
its own module (the vLLM and remote modules import their heavy parts only when built).
"""

from rlpost.rollout import continuous, hf_engine, remote_engine, vllm_engine  # noqa: F401
