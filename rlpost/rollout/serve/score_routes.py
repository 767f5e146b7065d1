"""``/v1/prompt_logprobs`` and ``/v1/tokenizer``: ``rlpost serve`` as a distillation teacher.

    GET  /v1/tokenizer          {"vocab_size", "vocab_sha256"} (rlpost.models.vocab)
    POST /v1/prompt_logprobs    {"prompts": [[id, ...], ...], "starts": [k, ...]}
                                -> {"logprobs": [[lp_k, ..., lp_{n-1}], ...], "policy_version"}

vLLM's ``prompt_logprobs`` at temperature 1 for the given ids. The pass runs in pieces between
decode steps (:meth:`~rlpost.rollout.engines.scheduler.Scheduler.run_between_steps`), its size
capped by ``--max-prompts``, ``--max-request-tokens``, the context and
``--max-score-entries``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from rlpost.models.vocab import vocab_digest
from rlpost.rollout.serve.openai_params import APIError, parse_json_object
from rlpost.train.lm_head import chunk_tokens

router = APIRouter(prefix="/v1")
# Padded positions through the decoder together: one piece of work between decode steps.
ROW_POSITIONS = 512


@router.get("/tokenizer")
async def tokenizer_info(request: Request) -> dict:
    state = request.app.state
    if getattr(state, "vocab_digest", None) is None:  # the first caller starts the one hash
        tok = state.service.tokenizer
        state.vocab_digest = asyncio.ensure_future(run_in_threadpool(vocab_digest, tok))
    return await asyncio.shield(state.vocab_digest)  # a caller who leaves keeps it going


@router.post("/prompt_logprobs")
async def prompt_logprobs(request: Request):
    service = request.app.state.service
    body = parse_json_object(await request.body())
    vocab = service.scheduler.model.config.vocab_size
    prompts, starts = parse_scoring(body, vocab, service.settings)
    service.budget.take(len(prompts))  # 429 when the server is full
    scheduler = service.scheduler
    # On the scheduler's thread, a piece at a time between decode steps (run_between_steps).
    pieces = score_pieces(scheduler.model, prompts, starts)
    future = scheduler.run_between_steps(encoded_rows(pieces))
    # Released when the work has ended, not when the client has: until then it holds memory.
    future.add_done_callback(lambda _: service.budget.release(len(prompts)))
    work = asyncio.wrap_future(future)
    try:
        if not await service.wait(request, [work]):
            return Response(status_code=499)  # nobody is listening
        rows_json = work.result()
    finally:
        future.cancel()  # stops it before its next piece; nothing when it has ended
    body = f'{{"logprobs": [{rows_json}], "policy_version": {scheduler.version}}}'
    return Response(body, media_type="application/json")


def parse_scoring(body: dict, vocab: int, settings) -> tuple[list[list[int]], list[int]]:
    """The request's sequences and start positions, checked; a 400 naming the first problem."""
    prompts, starts = body.get("prompts"), body.get("starts")
    if not isinstance(prompts, list) or not prompts:
        raise APIError(400, "prompts must be a non-empty list of token-id lists", "prompts")
    if len(prompts) > settings.max_prompts:
        why = f"{len(prompts)} prompts; this server takes at most {settings.max_prompts}"
        raise APIError(400, why, "prompts")
    if not isinstance(starts, list) or len(starts) != len(prompts):
        raise APIError(400, "starts must be a list with one position per prompt", "starts")
    limit = settings.max_model_len
    for i, (ids, k) in enumerate(zip(prompts, starts, strict=True)):
        if not isinstance(ids, list) or not ids:
            raise APIError(400, f"prompts[{i}] must be a non-empty list of token ids", "prompts")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompts[{i}] holds a token id outside [0, {vocab})", "prompts")
        if limit is not None and len(ids) > limit:
            why = f"prompts[{i}] has {len(ids)} tokens; the model's context is {limit}"
            raise APIError(400, why, "prompts")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(ids):
            raise APIError(
                400, f"starts[{i}]={k!r} must be an integer in [1, {len(ids)}]", "starts"
            )
    check_score_work(prompts, vocab, settings)
    return prompts, starts


def check_score_work(prompts: list[list[int]], vocab: int, settings) -> None:
    """A 400 naming the limit a scoring request passes: tokens, or padded logit entries."""
    total = sum(len(p) for p in prompts)
    if total > settings.max_request_tokens:
        why = f"{total} tokens in one request; this server takes at most "
        raise APIError(400, f"{why}{settings.max_request_tokens} (--max-request-tokens)", "prompts")
    longest = max(len(p) for p in prompts)
    entries = len(prompts) * longest * vocab
    if entries > settings.max_score_entries:
        why = f"{len(prompts)} prompts x {longest} positions (the longest) x {vocab} vocabulary"
        why += f" = {entries} logit entries; this server takes at most "
        why += f"{settings.max_score_entries} in one request (--max-score-entries)"
        raise APIError(400, why, "prompts")


def score_pieces(
    model, prompts: list[list[int]], starts: list[int], chunk: int = 0
) -> Generator[None, None, list[list[float]]]:
    """``log p(ids[t] | ids[:t])`` for ``t >= starts[i]`` of every sequence (float32 at
    temperature 1), by a generator that pauses after each bounded piece of work."""
    import torch

    vocab = model.config.vocab_size
    chunk = chunk_tokens(vocab, chunk)
    out: list[list[float]] = [[] for _ in prompts]
    for rows in _row_groups(prompts):
        with torch.no_grad():  # not across a pause: the grad mode is the thread's
            hidden, ids, head = _hidden(model, [prompts[i] for i in rows])
        yield
        lengths = [len(prompts[i]) for i in rows]
        picked = yield from _head_logprobs(hidden, ids, head, chunk, lengths)
        for i, lp in zip(rows, picked, strict=True):
            out[i] = lp[starts[i] - 1 :]
    return out


def encoded_rows(pieces: Generator[None, None, list[list[float]]], rows_per_piece: int = 16):
    """The rows ``pieces`` returns as JSON list items, a few rows per piece, so encoding does
    not hold the GIL from other requests for long."""
    rows = yield from pieces
    parts = []
    for s in range(0, len(rows), rows_per_piece):
        parts.append(
            ", ".join(json.dumps(row, allow_nan=False) for row in rows[s : s + rows_per_piece])
        )
        yield
    return ", ".join(parts)


def _row_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Row indices grouped by length (little padding), each group within ROW_POSITIONS padded
    positions (a single row may pass it)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * len(prompts[i]) <= ROW_POSITIONS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _hidden(model, prompts: list[list[int]]):
    """(the decoder's last hidden states ``[B, T, H]``, or the logits when the model's are
    more than head(hidden); the right-padded ids ``[B, T]``; the head or None)."""
    import torch

    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    ids, mask = ids.to(device), mask.to(device)
    head = _head(model)
    if head is None:  # a model whose logits are more than head(hidden): its own forward
        return model(input_ids=ids, attention_mask=mask).logits, ids, None
    return model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state, ids, head


def _head_logprobs(hidden, ids, head, chunk: int, lengths: list[int]):
    """Each row's ``log p(ids[t] | ids[:t])`` for ``1 <= t < lengths[i]``, the head over
    ``chunk`` positions at a time, pausing after each."""
    import torch

    flat_h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    picked = torch.empty(targets.shape[0], dtype=torch.float32)
    for s in range(0, targets.shape[0], chunk):
        with torch.no_grad():
            part = flat_h[s : s + chunk]
            logits = (part if head is None else head(part)).float()
            lse = torch.logsumexp(logits, dim=-1)
            chosen = logits.gather(-1, targets[s : s + chunk, None])[:, 0]
            picked[s : s + chunk] = (chosen - lse).cpu()
        yield
    rows = picked.view(ids.shape[0], ids.shape[1] - 1)
    return [rows[i, : n - 1].tolist() for i, n in enumerate(lengths)]


def _head(model):
    """The LM head when the logits are exactly ``head(decoder(...))``, else None."""
    from rlpost.train.lm_head import _LOGIT_TRANSFORMS

    getters = ("get_decoder", "get_output_embeddings")
    if not all(callable(getattr(model, g, None)) for g in getters):
        return None
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    if head is None or decoder is None or decoder is model:
        return None
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, key, None) not in (None, 1, 1.0) for key in _LOGIT_TRANSFORMS):
        return None
    return head
