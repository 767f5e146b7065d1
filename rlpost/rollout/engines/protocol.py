"""The rollout protocol every engine implements.

Token in, token out: prompt ids in, :class:`~rlpost.types.Completion` records out; weights
arrive through ``load_weights`` tagged with a version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from rlpost.types import Completion


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy; ``top_k == -1`` keeps all tokens;
    ``seed``: the request's own generator, leaving the engine's stream untouched."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    stop_texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all) or >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclass(frozen=True)
class LogitAdjust:
    """OpenAI's logit adjustments, before temperature; used only by the rollout server."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def active(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def prompt_seeds(seed: int | None, count: int) -> list[int | None]:
    """A request seed per prompt, ``seed + i`` (one seed for all would draw one stream for all)."""
    return [None if seed is None else seed + i for i in range(count)]


def adjust_logits(logits: torch.Tensor, sampled: list[int], adjust: LogitAdjust) -> torch.Tensor:
    """``logits`` [V] with the penalties for the ``sampled`` ids so far and the bias applied."""
    logits = logits.float().clone()
    if sampled and (adjust.presence_penalty or adjust.frequency_penalty):
        sampled_ids = torch.tensor(sampled, device=logits.device)
        counts = torch.bincount(sampled_ids, minlength=logits.shape[-1]).float()
        logits -= adjust.frequency_penalty * counts + adjust.presence_penalty * (counts > 0)
    if adjust.logit_bias:
        ids = torch.tensor([t for t, _ in adjust.logit_bias], device=logits.device)
        logits[ids] += torch.tensor([b for _, b in adjust.logit_bias], device=logits.device)
    return logits


class TokenRate:
    """An engine's throughput window: ``generate`` adds to ``tokens_generated`` and
    ``seconds``; :meth:`reset_stats` starts a new window."""

    tokens_generated: int = 0
    seconds: float = 0.0

    def throughput(self) -> float:
        """Generated tokens per second of ``generate`` since the last reset (0.0 if none)."""
        return self.tokens_generated / self.seconds if self.seconds > 0 else 0.0

    def reset_stats(self) -> None:
        self.tokens_generated = 0
        self.seconds = 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the pipeline needs from an engine: every method, none optional."""

    version: int
    tokenizer: object
    """The tokenizer its prompts were encoded with (text of completions, stop ids)."""
    generator: torch.Generator
    """The sampling stream (saved in checkpoints so a resumed run samples as the first)."""

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1, group_offset: int = 0
    ) -> list[Completion]:
        """``n`` samples for each prompt, grouped: completions ``i*n .. i*n+n-1`` belong to prompt i,
        whose ``group`` is ``group_offset + i``."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the serving weights and report ``version`` from now on."""
        ...

    def throughput(self) -> float:
        """Generated tokens per second since the last :meth:`reset_stats` (0.0 if none)."""
        ...

    def reset_stats(self) -> None:
        """Start a new throughput window."""
        ...

    def close(self) -> None:
        """Release threads, servers' connections and devices (idempotent)."""
        ...


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus. ``logits``: [B, V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it reaches top_p; the likeliest is kept
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


INVERSE_CDF_VOCAB = 32_768
"""From this vocabulary size up, a sample is drawn by inverting the CDF instead of
``torch.multinomial``, whose per-category draws cost more than the LM head
(docs/performance.md, "Sampling at a real vocabulary")."""


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) for ``logits`` [B, V], logprobs of the tempered, untruncated
    ``log_softmax(logits / T)`` the trainer recomputes."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    # x / 1.0 == x exactly: skip the [B, V] copy at T = 1
    scaled = logits if params.temperature == 1.0 else logits / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    if logits.shape[-1] >= INVERSE_CDF_VOCAB:
        # one exp: the draw's weights, their sum the untruncated log-softmax's normaliser
        top = scaled.amax(dim=-1, keepdim=True)
        weights = scaled.sub(top).exp_()
        log_norm = top + weights.sum(dim=-1, keepdim=True).log_()
        if filtered is not scaled:
            weights.masked_fill_(filtered == float("-inf"), 0.0)
        tokens = inverse_cdf_sample(weights, generator)
        return tokens, (scaled.gather(-1, tokens[:, None]) - log_norm).squeeze(-1)
    full = torch.log_softmax(scaled, dim=-1)
    tokens = _multinomial(torch.softmax(filtered, dim=-1), generator)
    return tokens, full.gather(-1, tokens[:, None]).squeeze(-1)


def _multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if generator is not None and generator.device != probs.device:
        # seeded streams draw on the CPU, alike on every device
        return torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


_CDF_BLOCK = 1024


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (non-negative, any positive row sum).

    Two levels in float64: a uniform picks a block of :data:`_CDF_BLOCK` tokens by the block
    sums' CDF, then a token by that block's own, so a row cumsums ``V / 1024 + 1024`` values.
    A zero-probability token is never picked."""
    rows, vocab = probs.shape
    full = vocab // _CDF_BLOCK * _CDF_BLOCK
    blocks = probs[:, :full].reshape(rows, -1, _CDF_BLOCK)
    tail = probs[:, full:]
    # float32 block sums (a float64 reduction costs 20x), accumulated in float64
    sums = blocks.sum(-1)
    if tail.shape[1]:
        sums = torch.cat([sums, tail.sum(-1, keepdim=True)], dim=1)
    sums = sums.double()
    device = generator.device if generator is not None else probs.device
    u = torch.rand(rows, 1, dtype=torch.float64, generator=generator, device=device)
    cdf = sums.cumsum(-1)
    u = u.to(probs.device) * cdf[:, -1:]
    block = torch.searchsorted(cdf, u, right=True).clamp_(max=sums.shape[1] - 1)
    # the block's own values, the tail zero-padded to a whole block
    inside = torch.zeros(rows, _CDF_BLOCK, dtype=torch.float64, device=probs.device)
    in_full = (block < blocks.shape[1]).squeeze(-1)
    if in_full.any():
        idx = in_full.nonzero().squeeze(-1)
        inside[idx] = blocks[idx, block[idx, 0]].double()
    if tail.shape[1] and not in_full.all():
        idx = (~in_full).nonzero().squeeze(-1)
        inside[idx, : tail.shape[1]] = tail[idx].double()
    before = cdf.gather(-1, block) - sums.gather(-1, block)
    local = inside.cumsum(-1)
    # the remaining mass, rescaled to this block's own sum (the two sums' rounding differ)
    share = ((u - before) / sums.gather(-1, block)).clamp_(0.0, 1.0)
    pick = torch.searchsorted(local, share * local[:, -1:], right=True)
    # never past the block's last token with probability (a share that rounded up to 1)
    last = (inside > 0).to(torch.int64).mul_(torch.arange(1, _CDF_BLOCK + 1, device=probs.device))
    pick = torch.minimum(pick, last.amax(-1, keepdim=True) - 1)
    return (block * _CDF_BLOCK + pick).squeeze(-1)
