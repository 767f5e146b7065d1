"""Shared test fixtures: a saved tiny checkpoint, quiet libraries, a small config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Rollout servers the tests start and the trainers that push weights to them share one admin
# key through the environment, as an operator's do: a server without one refuses weights.
TEST_ADMIN_KEY = os.environ.setdefault("RLPOST_ADMIN_KEY", "rlpost-test-admin-key")
ADMIN_HEADERS = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A built-in tiny model saved as an ordinary HF checkpoint directory."""
    from rlpost.models.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, intermediate_size=64
    )


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from rlpost.models.loading import load_causal_lm, load_tokenizer

    return load_causal_lm(tiny_dir), load_tokenizer(tiny_dir)


def small_overrides(tmp_path, **extra) -> list[str]:
    """Overrides for a seconds-long run of the default recipe."""
    base = {
        "run.output_dir": str(tmp_path),
        "run.name": "t",
        "model.tiny.hidden_size": 32,
        "model.tiny.intermediate_size": 64,
        "sft.steps": 5,
        "rollout.prompts_per_step": 4,
        "rollout.n": 4,
        "rollout.max_tokens": 4,
        "train.mini_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.steps": 3,
        "eval.limit": 16,
        "eval.every": 2,
        "eval.samples": 1,
        "checkpoint.every": 1,
        "observe.progress": False,
        "observe.plot": False,
        "reward.sample_every": 0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def pids_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``; each is read once, since a
    process may exit between listing /proc and reading its command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # exited while we looked, or not ours to read
            continue
        if marker.encode() in cmdline:
            found.append(int(entry.name))
    return found
