"""Datasets and tasks: the built-in arithmetic task and user JSONL / Parquet files."""

from rlpost.data.arith import arith_problems, arith_splits
from rlpost.data.files import DataError, LoadReport, load_prompt_file
from rlpost.data.sampler import PromptSampler

__all__ = [
    "DataError",
    "LoadReport",
    "PromptSampler",
    "arith_problems",
    "arith_splits",
    "load_prompt_file",
]
