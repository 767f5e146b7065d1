"""Rollout engines: the protocol every engine implements, and each engine."""
