"""Environments for multi-turn episodes: the protocol, the registry and the built-ins."""

from rlpost.envs.base import (
    ENVS,
    Action,
    Demonstration,
    EnvError,
    Environment,
    StepResult,
    ToolCall,
    environment,
)

__all__ = [
    "ENVS",
    "Action",
    "Demonstration",
    "EnvError",
    "Environment",
    "StepResult",
    "ToolCall",
    "environment",
]
