"""The training batch: completions laid out as tensors, and per-token log-probs.

Layout (verl's): prompts left-padded to width P, responses right-padded to
width T, concatenated into ``input_ids [B, P + T]``. The logits at positions
``P - 1 .. P + T - 2`` predict the response tokens, so every response tensor is
``[B, T]`` with ``response_mask`` marking real (and trainable) tokens.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, fields, replace

import torch

from rlpost.algos.entropy import entropy_from_logits
from rlpost.observe.threads import pace
from rlpost.train.lm_head import (
    embed_tokens,
    head_logprobs,
    head_sum_pi_squared,
    needs_chunks,
    split_head,
)
from rlpost.train.optim import budget_slices
from rlpost.train.packing import Pack, pack_for, packed_forward, scatter
from rlpost.types import Completion


@dataclass
class TrainBatch:
    """Tensors of one rollout batch. Shapes: B rows, P prompt width, T response width.

    input_ids, attention_mask, position_ids: [B, P + T] (int64)
    responses: [B, T] sampled token ids; response_mask: [B, T] float32 (1 = trained token)
    group: [B] int64 prompt index; rollout_logprobs: [B, T] float32 (engine's)
    old_logprobs, ref_logprobs, advantages, returns, token_level_rewards: [B, T] float32 or None
    scores: [B] float32 outcome rewards; token_versions: [B, T] int64 policy version that
    sampled each response token (-1 on padding)"""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    group: torch.Tensor
    rollout_logprobs: torch.Tensor
    scores: torch.Tensor
    token_versions: torch.Tensor
    prompt_width: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    # on-policy distillation (rlpost.train.teacher): logprobs [B, T], logits [B, T, V]
    teacher_logprobs: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> TrainBatch:
        """Rows ``idx`` of every [B, ...] tensor (a mini- or micro-batch)."""
        return self._map(lambda v: v[idx])

    def _map(self, fn) -> TrainBatch:
        """A copy with ``fn(tensor)`` in place of every tensor field."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: fn(v) for k, v in tensors.items() if torch.is_tensor(v)})

    def lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt lengths [B], response lengths [B]) in tokens, padding left out."""
        P = self.prompt_width
        return self.attention_mask[:, :P].sum(-1), self.attention_mask[:, P:].sum(-1)

    def trimmed(self) -> TrainBatch:
        """The same rows without the columns that are padding in every row; response tensors
        become ``[B, T']`` (:func:`pad_responses` restores T)."""
        prompt_lens, response_lens = self.lengths()
        keep_p = max(1, int(prompt_lens.max()))
        keep_t = max(1, int(response_lens.max()))
        P, T = self.prompt_width, self.responses.shape[1]
        if keep_p == P and keep_t == T:
            return self
        changes = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                continue
            if v.shape[1] == P + T:
                changes[f.name] = v[:, P - keep_p : P + keep_t]
            elif v.shape[1] == T:
                changes[f.name] = v[:, :keep_t]
        return replace(self, prompt_width=keep_p, **changes)

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor on ``device`` (tensors already there are the same objects)."""
        return self._map(lambda v: v.to(device))


def pad_responses(values: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, T']`` per-token values right-padded with 0 to ``[b, width]`` (undoes
    :meth:`TrainBatch.trimmed`)."""
    extra = width - values.shape[1]
    return torch.nn.functional.pad(values, (0, extra)) if extra > 0 else values


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s parameters (where its inputs go)."""
    return next(model.parameters()).device


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode inside the block, back in its own mode after (even on error)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def collate(completions: list[Completion], scores: list[float], pad_id: int) -> TrainBatch:
    """Lay completions out as a :class:`TrainBatch` (scores are the outcome rewards)."""
    if not completions:
        raise ValueError("cannot build a training batch from zero completions")
    P = max(len(c.prompt_ids) for c in completions)
    T = max(1, max(len(c.token_ids) for c in completions))
    # one tensor per field: a tensor per row and field costs more than the default model
    ids_rows, attn_rows, lp_rows, ver_rows, mask_rows = [], [], [], [], []
    for c in completions:
        left, right = P - len(c.prompt_ids), T - len(c.token_ids)
        ids_rows.append([pad_id] * left + list(c.prompt_ids) + list(c.token_ids) + [pad_id] * right)
        attn_rows.append([0] * left + [1] * (P - left + T - right) + [0] * right)
        lp_rows.append(list(c.logprobs) + [0.0] * right)
        ver_rows.append(c.versions_per_token() + [-1] * right)
        mask = c.loss_mask if c.loss_mask is not None else [1] * (T - right)
        mask_rows.append(list(mask) + [0] * right)
    input_ids = torch.tensor(ids_rows, dtype=torch.long)
    attn = torch.tensor(attn_rows, dtype=torch.long)
    response_mask = torch.tensor(mask_rows, dtype=torch.float32)
    rollout_lp = torch.tensor(lp_rows, dtype=torch.float32)
    versions = torch.tensor(ver_rows, dtype=torch.long)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=position_ids,
        responses=input_ids[:, P:].clone(),
        response_mask=response_mask,
        group=torch.tensor([c.group for c in completions], dtype=torch.long),
        rollout_logprobs=rollout_lp,
        scores=torch.tensor(scores, dtype=torch.float32),
        token_versions=versions,
        prompt_width=P,
    )


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (transformers' causal LMs do)."""
    known = _KEEPS_LOGITS.get(type(model))
    if known is None:
        known = "logits_to_keep" in inspect.signature(model.forward).parameters
        _KEEPS_LOGITS[type(model)] = known
    return known


_KEEPS_LOGITS: dict[type, bool] = {}


def response_logits(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Logits [B, T, V] that predict the response tokens, the head on ``T + 1`` positions."""
    T = batch.responses.shape[1]
    extra = {"logits_to_keep": T + 1} if keeps_logits(model) else {}
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        **extra,
    )
    return out.logits[:, -(T + 1) : -1, :]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) at ``tokens``: [B, T, V], [B, T] -> [B, T] float32."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    # logsumexp + gather keeps memory at one [B, T, V] tensor (no full log_softmax copy).
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


FULL_LOGITS = -1
"""``chunk`` value that computes the whole ``[B, T, V]`` logits at once (the unchunked path)."""


def response_hidden(
    model: torch.nn.Module, batch: TrainBatch, chunk: int = 0, packed: Pack = Pack.PADDED
):
    """(hidden [N, H] of the real response tokens, their targets [N], where [B, T] bool, head),
    or None when the head cannot be split off (:func:`split_head`) or the logits fit one
    chunk outside autocast (under it the chunked head keeps them float32, as engines do).
    ``packed``: the decoder runs on the rows packed (:mod:`rlpost.train.packing`)."""
    split = split_head(model)
    T = batch.responses.shape[1]
    tokens = int(batch.attention_mask[:, -T:].sum()) if packed else len(batch) * T
    autocast = torch.is_autocast_enabled(batch.input_ids.device.type)
    if split is None or not (autocast or needs_chunks(tokens, split[1].weight.shape[0], chunk)):
        return None
    decoder, head = split
    # The lookup adds its gradient into the (tied) weight's own: lm_head.grad_sink.
    embed = decoder.get_input_embeddings()
    if packed:
        rows = pack_for(batch, model, packed)
        embeds = embed_tokens(embed, rows.input_ids)
        hidden = rows.gather(packed_forward(decoder, rows, inputs_embeds=embeds).last_hidden_state)
        return hidden, rows.targets, rows.where, head
    out = decoder(
        inputs_embeds=embed_tokens(embed, batch.input_ids),
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    where = batch.attention_mask[:, -T:].bool()
    hidden = out.last_hidden_state[:, -(T + 1) : -1][where]
    return hidden, batch.responses[where], where, head


def _full_logits(model: torch.nn.Module, batch: TrainBatch, packed: Pack):
    """(logits [..., V], targets [...], a function laying [...] out as [B, T]): ``[B, T, V]``
    padded, or ``[1, N, V]`` packed."""
    if not packed:
        return response_logits(model, batch), batch.responses, lambda v: v
    rows = pack_for(batch, model, packed)
    if keeps_logits(model) and len(rows.input_ids) == 1:  # the head on the responses only
        logits = packed_forward(model, rows, logits_to_keep=rows.at).logits
    else:
        logits = rows.gather(packed_forward(model, rows).logits)[None]
    return logits, rows.targets[None], lambda v: rows.scatter(v[0])


def response_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk: int = 0,
    packed: Pack = Pack.PADDED,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [B, T], entropy [B, T] or None) of the responses, float32, differentiable;
    the head runs ``chunk`` tokens at a time (0: by vocabulary; :data:`FULL_LOGITS`: whole)."""
    split = None if chunk == FULL_LOGITS else response_hidden(model, batch, chunk, packed)
    if split is None:
        logits, targets, lay_out = _full_logits(model, batch, packed)
        logprobs = lay_out(token_logprobs(logits, targets, temperature))
        if not with_entropy:
            return logprobs, None
        tau = temperature if temperature not in (0.0, 1.0) else 1.0
        return logprobs, lay_out(entropy_from_logits(logits.float() / tau))
    hidden, targets, where, head = split
    lp, ent = head_logprobs(
        hidden, head, targets, temperature=temperature, with_entropy=with_entropy, chunk=chunk
    )
    return scatter(lp, where), (None if ent is None else scatter(ent, where))


def response_sum_pi_squared(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float,
    *,
    chunk: int = 0,
    packed: Pack = Pack.PADDED,
) -> torch.Tensor:
    """``[B, T]`` ``sum_v pi(v)^2`` at each response position (no gradient; 0 on padding)."""
    split = None if chunk == FULL_LOGITS else response_hidden(model, batch, chunk, packed)
    if split is None:
        logits, _, lay_out = _full_logits(model, batch, packed)
        return lay_out(torch.softmax(logits.float() / temperature, dim=-1).pow(2).sum(-1))
    hidden, _, where, head = split
    return scatter(head_sum_pi_squared(hidden, head, temperature=temperature, chunk=chunk), where)


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    *,
    temperature: float,
    micro_batch_size: int,
    chunk: int = 0,
    max_tokens: int = 0,
    packed: Pack = Pack.PADDED,
) -> torch.Tensor:
    """Per-token logprobs [B, T] of the batch's responses under ``model`` (no gradient),
    passes cut as :func:`score_rows`."""
    return score_rows(
        model,
        batch,
        lambda mb: response_logprobs(model, mb, temperature, chunk=chunk, packed=packed)[0],
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        packed=packed,
    )


def score_rows(
    model,
    batch: TrainBatch,
    fn,
    *,
    micro_batch_size: int,
    max_tokens: int = 0,
    packed: Pack = Pack.PADDED,
):
    """``fn(micro) -> [b, T]`` over micro-batches of ``batch`` in eval mode, as ``[B, T]``;
    ``max_tokens`` > 0 cuts them by :func:`rlpost.train.optim.budget_slices`."""
    device = model_device(model)
    groups = Pack(packed).groups(batch)
    # With shared prompts a group's rows go together (their prompt runs once).
    rows = torch.arange(len(batch)) if groups is None else torch.sort(groups, stable=True).indices
    T = batch.responses.shape[1]
    out = None
    lens = batch.lengths()
    slices = budget_slices(rows, *lens, micro_batch_size, max_tokens, packed=packed, groups=groups)
    with eval_mode(model):
        for idx in slices:
            pace()  # the cores a co-located rollout process lends: observe.threads
            mb = batch.select(idx)
            mb = (mb.trimmed() if max_tokens > 0 else mb).to(device)
            values = pad_responses(fn(mb), T)
            if out is None:
                out = values.new_zeros((len(batch), T))
            out[idx.to(values.device)] = values
    return out
