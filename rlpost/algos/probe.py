"""One call of a user's algorithm part on a dummy batch, before any work.

A part from the user's code (``algo.loss.name=my.py:fn``) is called here once, as the trainer would
call it, on :data:`ROWS` rows of :data:`TOKENS` tokens of seeded random tensors (two groups, one
short row). A signature that does not bind, an exception, a wrong return type or shape, or a NaN is
one line naming the function, its file and line, and the input. The built-in parts are held to the
same contracts by their tests."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlpost.algos.advantages import ADVANTAGES
from rlpost.algos.aggregate import AGGREGATIONS, Aggregation
from rlpost.algos.correction import CORRECTIONS, CorrectionOutput
from rlpost.algos.kl import KL_ESTIMATORS
from rlpost.algos.policy_losses import POLICY_LOSSES, LossInputs, PolicyLossOutput
from rlpost.registry import Registry, where

ROWS, TOKENS = 4, 6
INPUT = f"a dummy batch of {ROWS} rows x {TOKENS} tokens"


def _batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(ROWS, TOKENS)
    mask[1, 4:] = mask[3, 2:] = 0
    logprobs = -torch.rand(ROWS, TOKENS, generator=g) - 0.1
    rewards = torch.zeros(ROWS, TOKENS)
    rewards[torch.arange(ROWS), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    return {
        "logprobs": logprobs.requires_grad_(),
        "old": logprobs.detach() + 0.05 * torch.randn(ROWS, TOKENS, generator=g),
        "advantages": torch.randn(ROWS, TOKENS, generator=g) * mask,
        "mask": mask,
        "group": torch.tensor([0, 0, 1, 1]),
        "rewards": rewards,
    }


def _tensor(out: Any, shape: tuple[int, ...], what: str) -> str | None:
    if not isinstance(out, Tensor):
        return f"returned {type(out).__name__} where {what} is a tensor"
    if tuple(out.shape) != shape:
        return f"returned {what} of shape {tuple(out.shape)}, expected {shape}"
    if not torch.isfinite(out.detach().float()).all():
        return f"returned a non-finite {what} (NaN or inf)"
    return None


def _advantage(fn: Callable, params: Any, b: dict, spec: str) -> tuple[tuple, dict, Callable]:
    kw = dict(params.params())
    if ADVANTAGES.trait(spec, "needs_critic"):
        kw["values"] = torch.zeros(ROWS, TOKENS)

    def check(out: Any) -> str | None:
        if not (isinstance(out, tuple) and len(out) == 2):
            return f"returned {type(out).__name__} where (advantages, returns) is expected"
        return _tensor(out[0], (ROWS, TOKENS), "advantages") or _tensor(
            out[1], (ROWS, TOKENS), "returns"
        )

    return (b["rewards"], b["mask"], b["group"]), kw, check


def _loss(fn: Callable, params: Any, b: dict, spec: str) -> tuple[tuple, dict, Callable]:
    agg = Aggregation.for_minibatch(b["mask"])
    x = LossInputs(b["logprobs"], b["old"], b["advantages"], b["mask"], agg)

    def check(out: Any) -> str | None:
        if not isinstance(out, PolicyLossOutput):
            return f"returned {type(out).__name__} where PolicyLossOutput(loss, stats) is expected"
        return _tensor(out.loss, (), "loss")

    return (x, params), {}, check


def _kl(fn: Callable, params: Any, b: dict, spec: str) -> tuple[tuple, dict, Callable]:
    return (b["logprobs"], b["old"]), {}, lambda out: _tensor(out, (ROWS, TOKENS), "KL")


def _aggregation(fn: Callable, params: Any, b: dict, spec: str) -> tuple[tuple, dict, Callable]:
    agg = Aggregation(spec).counts(b["mask"])
    return (b["old"], b["mask"], agg), {}, lambda out: _tensor(out, (), "loss")


def _correction(fn: Callable, params: Any, b: dict, spec: str) -> tuple[tuple, dict, Callable]:
    def check(out: Any) -> str | None:
        if not isinstance(out, CorrectionOutput):
            return f"returned {type(out).__name__} where CorrectionOutput is expected"
        return _tensor(out.weights, (ROWS, TOKENS), "weights")

    return (b["logprobs"].detach(), b["old"], b["mask"], params), {}, check


CONTRACTS: dict[str, tuple[Registry, Callable, str]] = {
    "advantage": (ADVANTAGES, _advantage,
                  "fn(token_level_rewards, response_mask, group, **params) -> (advantages, returns)"),
    "loss": (POLICY_LOSSES, _loss, "fn(x: LossInputs, params) -> PolicyLossOutput"),
    "kl": (KL_ESTIMATORS, _kl, "fn(logprobs, ref_logprobs) -> [B, T] tensor"),
    "aggregation": (AGGREGATIONS, _aggregation, "fn(loss_mat, mask, agg: Aggregation) -> scalar"),
    "correction": (CORRECTIONS, _correction,
                   "fn(proximal_logprobs, rollout_logprobs, response_mask, params) -> CorrectionOutput"),
}  # fmt: skip
"""Each kind of algorithm part: its registry, its dummy call and the signature it is called with."""


def probe(kind: str, spec: str, params: Any = None) -> str | None:
    """Why the part ``spec`` of ``kind`` (a key of :data:`CONTRACTS`) fails its dummy call, in one
    line, or None. ``params``: its config record (its keys beside ``name``). An unknown name or a
    file that does not import is the registry's one line."""
    registry, call, signature = CONTRACTS[kind]
    fn = inspect.unwrap(registry.get(spec))  # the user's own function, its errors said here
    args, kw, check = call(fn, params, _batch(), spec)
    who = f"{where(fn)}"
    try:
        inspect.signature(fn).bind(*args, **kw)
    except TypeError as exc:
        return f"{who} does not take the call of a {registry.kind}, {signature} ({exc})"
    except ValueError:  # no signature to read (a builtin): the call says it
        pass
    try:
        with torch.enable_grad():
            problem = check(fn(*args, **kw))
    except Exception as exc:  # the user's code: whatever it raises is its own, said in one line
        text = str(exc).strip().splitlines()
        problem = f"raised {type(exc).__name__}" + (f": {text[0]}" if text else "")
    return problem and f"{who} {problem} on {INPUT}"
