"""rlpost: reinforcement-learning post-training of language models.

The Python API (:mod:`rlpost.api`) is importable from here: ``rlpost.Base``, ``rlpost.LoRA``,
``rlpost.Datum``, ``rlpost.SamplingParams``, ``rlpost.train``; torch loads on first use.
"""

__version__ = "0.1.0"

_API = "APIError Base Datum ForwardBackward LoRA Policy Sampler SamplingParams train".split()


def __getattr__(name: str):
    if name in _API:
        from rlpost import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlpost' has no attribute {name!r}")
