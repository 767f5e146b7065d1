"""The LM head in chunks of tokens: log-probabilities and entropy without the [N, V] logits.

With a real vocabulary the ``[B, T, V]`` float32 logits are a step's largest tensor. Here
hidden states go through the head ``chunk`` tokens at a time, and the backward
(:class:`ChunkedHeadLogprobs`) recomputes a chunk's logits, so the head holds one ``[chunk,
V]`` whatever the length (as TRL's chunked entropy and Liger's fused linear cross-entropy).
The head's and the lookup's (:func:`embed_tokens`) weight gradients go into ``.grad`` in place
(:func:`grad_sink`).

Formulas, per token with tempered logits ``z = (h W^T + b) / tau``:
``logp_t = z_t - logsumexp(z)``, ``H = logsumexp(z) - sum_v p_v z_v`` and the
gradients ``d logp_t / dz = onehot(t) - p``, ``dH / dz = -p (log p + H)``.

A head split by vocabulary over tensor-parallel ranks (:func:`rlpost.train.tp.vocab_shard`)
all-reduces the max, the softmax's sums and the target's logit (Megatron's
vocabulary-parallel cross-entropy).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlpost.observe.mfu import cpu_vendor
from rlpost.observe.threads import pace
from rlpost.train.tp import vocab_shard

CHUNK_BYTES = 64 * 2**20
"""Float32 logits per chunk (the backward holds about four such tensors at once)."""

# Config fields of models whose logits are more than ``lm_head(hidden)``: the full head's.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def needs_chunks(tokens: int, vocab: int, setting: int = 0) -> bool:
    """Whether ``tokens`` positions' logits go through the head in chunks: always when
    ``setting`` is positive, else when they exceed one chunk."""
    return setting > 0 or tokens > chunk_tokens(vocab, setting)


def chunk_tokens(vocab: int, setting: int = 0) -> int:
    """Tokens per chunk: ``setting`` when positive, else what fits :data:`CHUNK_BYTES`."""
    if setting > 0:
        return setting
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, head) of a causal LM whose logits are exactly ``head(decoder(...))``, else None
    (an FSDP model, whose root's hooks gather the head in the full forward only)."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    getters = ("get_decoder", "get_output_embeddings")
    if not all(callable(getattr(base, g, None)) for g in getters):
        return None
    head, decoder = base.get_output_embeddings(), base.get_decoder()
    if type(head) is not nn.Linear or decoder is None or decoder is base:
        return None
    cfg = getattr(base, "config", None)
    for key in _LOGIT_TRANSFORMS:
        value = getattr(cfg, key, None)
        if value not in (None, 1, 1.0):
            return None
    return decoder, head


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The head's matmul dtype: float32 (the weight's where wider), under bf16 autocast too,
    as a bf16 head rounds differently in the trainer's chunks and an engine's decode steps."""
    return torch.promote_types(weight.dtype, torch.float32)


ONEDNN_MIN_VOCAB = 32_768
"""Heads of at least this many tokens take oneDNN's float32 kernel on CPU (:func:`head_linear`)."""


@functools.cache
def _onednn_linear() -> bool:
    """Whether oneDNN's linear runs and agrees with torch's, both float32 whatever the caller's
    autocast (once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        try:
            got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        except (AttributeError, RuntimeError):
            return False
        return bool(torch.allclose(got, x @ w.t(), rtol=1e-4, atol=1e-5))


def head_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for an LM head ``weight [V, H]`` and ``x [..., H]``.

    On CPU in float32 with a vocabulary of :data:`ONEDNN_MIN_VOCAB` or more and no gradient
    wanted, oneDNN's linear, faster than MKL's sgemm at the head's skinny shapes. ``x`` goes
    as rows: a strided 3-d ``x`` ran as a bmm over a per-row copy of the weight
    (docs/performance.md)."""
    rows = x.reshape(-1, x.shape[-1])  # a view where the rows allow it
    if _onednn_head(x, weight):
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")
    else:
        out = nn.functional.linear(rows, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _onednn_head(x: Tensor, weight: Tensor) -> bool:
    wanted = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.shape[0] >= ONEDNN_MIN_VOCAB
        and not wanted
        and _onednn_linear()
    )


class ServingHead(nn.Linear):
    """An engine's LM head: :func:`head_linear` in the weight's dtype whatever autocast says,
    as the trainer's head (:func:`compute_dtype`)."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return head_linear(x.to(self.weight.dtype), self.weight, self.bias)


def serve_head(model: nn.Module) -> nn.Module:
    """``model`` with its plain ``nn.Linear`` head made a :class:`ServingHead` in place."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is nn.Linear:
        head.__class__ = ServingHead  # forward alone differs; a copy or pickle keeps it
    return model


AUTOCAST = "serving_autocast"
"""Attribute of a serving module whose forward runs under autocast to that dtype."""


def bf16_serving(model: nn.Module) -> nn.Module:
    """``model`` made to compute as a trainer under bf16 autocast does, in place: linear
    weights cast to bf16 once, embeddings, norms and head left float32, the forward under
    :func:`serving_precision`. Wholly in bf16, SmolLM2-135M sampled 0.037 nats a token away
    from the trainer's logprobs."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for m in model.modules():
        if isinstance(m, nn.Linear) and m is not head:
            m.to(torch.bfloat16)
    setattr(model, AUTOCAST, torch.bfloat16)
    return model


def serving_precision(model: nn.Module):
    """The context an engine runs ``model``'s forward in: bf16 autocast for a
    :func:`bf16_serving` model, else none."""
    dtype = getattr(model, AUTOCAST, None)
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=dtype, enabled=dtype is not None)


@functools.cache
def _intel_cpu() -> bool:
    return cpu_vendor() == "GenuineIntel"  # read once: /proc/cpuinfo does not change


def _chunk_onednn(h: Tensor, weight: Tensor) -> bool:
    """Whether a pass's float32 chunk takes oneDNN's kernel: as :func:`head_linear`, but not on
    Intel, where MKL into the reused buffer is faster (docs/performance.md)."""
    return _onednn_head(h, weight) and not _intel_cpu()


class _Scratch:
    """A pass's reused ``[c, V]`` tensors, each made on first use: a fresh one is past glibc's
    mmap threshold, so every chunk would map, fault in and unmap it again."""

    def __init__(self, hidden: Tensor, weight: Tensor, chunk: int):
        self.rows, self.vocab = min(chunk, hidden.shape[0]), weight.shape[0]
        self.device, self._made = hidden.device, {}

    def get(self, name: str, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        t = self._made.get(name)
        if t is None:
            t = torch.empty(self.rows, self.vocab, dtype=dtype, device=self.device)
            self._made[name] = t
        return t[:n]


def _chunk_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, tau: float, dtype, scratch: _Scratch
) -> Tensor:
    """Float32 tempered logits ``[c, V]`` of ``h [c, H]`` (``weight`` already in ``dtype``),
    rounded as the full head under autocast would."""
    n = h.shape[0]
    if dtype != torch.float32:
        low = torch.mm(h.to(dtype), weight.t(), out=scratch.get("low", n, dtype))
        if bias is not None:
            low += bias.to(dtype)
        z = scratch.get("logits", n).copy_(low)
    elif _chunk_onednn(h, weight):  # a fresh [c, V] (no out= form)
        z = head_linear(h.float(), weight, bias)
    else:
        z = torch.mm(h.float(), weight.t(), out=scratch.get("logits", n))
        if bias is not None:
            z += bias.float()
    return z.div_(tau) if tau != 1.0 else z


class ChunkedHeadLogprobs(torch.autograd.Function):
    """(logprobs [N], entropy [N]) of ``targets [N]`` from ``hidden [N, H]`` and the head
    ``weight [V, H]`` (``bias [V]`` or None), ``chunk`` tokens of logits at a time.

    Differentiable in ``hidden``, ``weight`` and ``bias``; ``entropy`` is zeros unless
    ``with_entropy``, and an unused output costs nothing in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tau, chunk, with_entropy, dtype, shard=None):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        w = weight.to(dtype)
        scratch = _Scratch(hidden, weight, chunk)
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, n, chunk):
                pace()  # the cores a co-located rollout process lends: observe.threads
                hi = min(n, lo + chunk)
                z = _chunk_logits(hidden[lo:hi], w, bias, tau, dtype, scratch)
                index, mine = _local_targets(targets[lo:hi], shard, z.shape[-1])
                target = z.gather(-1, index[:, None]).squeeze(-1)
                top = z.amax(dim=-1, keepdim=True)
                if shard is not None:
                    target = torch.where(mine, target, 0.0)
                    dist.all_reduce(top, dist.ReduceOp.MAX, group=shard[0])
                z.sub_(top)  # z' = z - max <= 0, in place: logsumexp's own steps
                if with_entropy:
                    e = torch.exp(z, out=scratch.get("probs", hi - lo))
                    total, ez = e.sum(-1), e.mul_(z).sum(-1)
                    total, ez, target = _summed(shard, total, ez, target)
                    lse[lo:hi] = top.squeeze(-1) + total.log()
                    # H = log s - sum e z' / s: two non-negative terms, no cancellation
                    entropy[lo:hi] = total.log() - ez / total
                else:
                    total, target = _summed(shard, z.exp_().sum(-1), target)
                    lse[lo:hi] = top.squeeze(-1) + total.log_()
                logprobs[lo:hi] = target - lse[lo:hi]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.settings = (tau, chunk, with_entropy, dtype, shard)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        tau, chunk, with_entropy, dtype, shard = ctx.settings
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        sink = grad_sink(weight if shard is None else shard[2]) if want_w else None
        grad_w = (
            sink
            if sink is not None or not want_w
            else torch.zeros_like(weight, dtype=torch.float32)
        )
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
        use_entropy = with_entropy and grad_entropy is not None
        # a bf16 pass's float32 weight gradient on CPU: one float32 addmm, faster and unrounded
        exact_w = (
            grad_w is not None and grad_w.dtype == torch.float32 and weight.device.type == "cpu"
        )
        w = weight.to(dtype)
        scratch = _Scratch(hidden, weight, chunk)
        for lo in range(0, hidden.shape[0], chunk):
            pace()
            hi = min(hidden.shape[0], lo + chunk)
            h = hidden[lo:hi]
            logp = _chunk_logits(h, w, bias, tau, dtype, scratch).sub_(lse[lo:hi, None])
            if use_entropy:
                p = torch.exp(logp, out=scratch.get("probs", hi - lo))
                ent = logp.add_(entropy[lo:hi, None]).mul_(p).mul_(-grad_entropy[lo:hi, None])
            else:
                p, ent = logp.exp_(), None
            if grad_logprobs is not None:
                g = grad_logprobs[lo:hi, None]
                index, mine = _local_targets(targets[lo:hi], shard, p.shape[-1])
                at = g if mine is None else g * mine[:, None]  # another rank's token: not here
                gz = p.mul_(-g).scatter_add_(-1, index[:, None], at)
            else:
                gz = p.zero_()
            if ent is not None:
                gz += ent
            del p, ent
            if tau != 1.0:
                gz.div_(tau)
            if grad_b is not None:
                grad_b += gz.sum(0)
            low = gz if dtype == torch.float32 else scratch.get("low", hi - lo, dtype).copy_(gz)
            if grad_h is not None:
                grad_h[lo:hi] = (low @ w).to(hidden.dtype)
            if exact_w:
                grad_w.addmm_(gz.t(), h.float())
            elif grad_w is not None:
                if grad_w.dtype == dtype:  # accumulate inside the matmul: no [V, H] temporary
                    grad_w.addmm_(low.t(), h.to(dtype))
                else:
                    grad_w += (low.t() @ h.to(dtype)).float()
        if grad_h is not None and shard is not None:  # each rank's rows' part of the sum
            total = grad_h.float()
            dist.all_reduce(total, group=shard[0])
            grad_h = total.to(hidden.dtype)
        grad_w = None if grad_w is None or sink is not None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _local_targets(targets: Tensor, shard, rows: int) -> tuple[Tensor, Tensor | None]:
    """(column of each target among this rank's ``rows``, which of them this rank holds or None)."""
    if shard is None:
        return targets, None
    local = targets - shard[1]
    mine = (local >= 0) & (local < rows)
    return torch.where(mine, local, 0), mine


def _summed(shard, *values: Tensor) -> tuple[Tensor, ...]:
    """``values`` ([c] each) summed over the vocabulary-split group in one all-reduce."""
    if shard is None:
        return values
    stacked = torch.stack([v.float() for v in values])
    dist.all_reduce(stacked, group=shard[0])
    return tuple(stacked)


def _in_place_ok(weight: Tensor) -> bool:
    if not (weight.is_leaf and weight.requires_grad and weight.dtype == torch.float32):
        return False
    return not (weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None))


def grad_sink(weight: Tensor) -> Tensor | None:
    """``weight.grad`` (zeros when it has none yet) when a backward may add a gradient into it
    itself, as autograd's own accumulation would: a float32 leaf that takes gradients and has
    no hooks; else None. It saves a tied embedding's three ``[V, H]`` gradients
    (docs/performance.md), but they reach ``.grad`` under ``backward()`` only, not
    ``torch.autograd.grad``."""
    if not _in_place_ok(weight):
        return None
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    # a DTensor's (a vocabulary-split head's): its local shard, which shares its storage
    return weight.grad.to_local() if hasattr(weight.grad, "device_mesh") else weight.grad


class _EmbedIntoGrad(torch.autograd.Function):
    """``embedding(ids, weight)`` whose backward adds into ``weight.grad`` (:func:`grad_sink`);
    ``shard`` as Megatron's vocabulary-parallel embedding."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, shard=None):
        index, mine = _local_targets(ids, shard, weight.shape[0])
        out = torch.nn.functional.embedding(index, weight)
        if shard is not None:
            out.mul_(mine[..., None])
            dist.all_reduce(out, group=shard[0])
        ctx.save_for_backward(weight, index, mine if shard is not None else None)
        ctx.padding_idx, ctx.shard = padding_idx, shard
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, ids, mine = ctx.saved_tensors
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        keep = torch.ones_like(ids, dtype=torch.bool) if mine is None else mine.reshape(-1)
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row takes no gradient
            keep &= ids != ctx.padding_idx - (0 if ctx.shard is None else ctx.shard[1])
        ids, grad = ids[keep], grad[keep]
        sink = grad_sink(weight if ctx.shard is None else ctx.shard[2])
        if sink is None:  # the weight changed since the forward (hooked, frozen): return it
            return torch.zeros_like(weight).index_add_(0, ids, grad), None, None, None
        sink.index_add_(0, ids, grad)
        return None, None, None, None


def embed_tokens(embedding: nn.Module, ids: Tensor) -> Tensor:
    """``embedding(ids)``, by :class:`_EmbedIntoGrad` for a plain ``nn.Embedding`` whose weight
    takes gradients in place (:func:`grad_sink`)."""
    plain = type(embedding) is nn.Embedding and embedding.max_norm is None
    plain = plain and not (embedding.sparse or embedding.scale_grad_by_freq)
    if not (plain and torch.is_grad_enabled() and _in_place_ok(embedding.weight)):
        return embedding(ids)
    local, _, shard = vocab_shard(embedding)
    if shard is None and hasattr(local, "device_mesh"):  # another layout's DTensor
        return embedding(ids)
    return _EmbedIntoGrad.apply(local, ids, embedding.padding_idx, shard)


def head_logprobs(
    hidden: Tensor,
    head: nn.Linear,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """(logprobs [N], entropy [N] or None) of ``targets [N]`` under ``softmax(head(hidden) / T)``.

    ``hidden [N, H]``; T = 1 when ``temperature`` is 0 or 1; ``chunk`` 0: :data:`CHUNK_BYTES`."""
    tau = 1.0 if temperature in (0.0, 1.0) else float(temperature)
    size = chunk_tokens(head.weight.shape[0], chunk)
    weight, bias, shard = vocab_shard(head)
    lp, ent = ChunkedHeadLogprobs.apply(
        hidden, weight, bias, targets, tau, size, with_entropy, compute_dtype(weight), shard
    )
    return lp, (ent if with_entropy else None)


@torch.no_grad()
def head_sum_pi_squared(
    hidden: Tensor, head: nn.Linear, *, temperature: float = 1.0, chunk: int = 0
) -> Tensor:
    """``sum_v softmax(head(hidden) / T)_v^2`` per token: ``[N, H]`` -> ``[N]`` float32."""
    tau = 1.0 if temperature in (0.0, 1.0) else float(temperature)
    size = chunk_tokens(head.weight.shape[0], chunk)
    weight, bias, shard = vocab_shard(head)
    dtype = compute_dtype(weight)
    out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    w = weight.to(dtype)
    scratch = _Scratch(hidden, weight, size)
    for lo in range(0, hidden.shape[0], size):
        z = _chunk_logits(hidden[lo : lo + size], w, bias, tau, dtype, scratch)
        top = z.amax(dim=-1, keepdim=True)
        if shard is not None:
            dist.all_reduce(top, dist.ReduceOp.MAX, group=shard[0])
        e = z.sub_(top).exp_()  # the softmax's steps, in place
        total, squares = _summed(shard, e.sum(-1), e.pow_(2).sum(-1))
        out[lo : lo + size] = squares / total.square()
    return out
