"""``/v1/prompt_logprobs`` and ``/v1/tokenizer``: ``rlpost serve`` as a distillation teacher.

    GET  /v1/tokenizer          {"vocab_size", "vocab_sha256"} (rlpost.models.vocab)
    POST /v1/prompt_logprobs    {"prompts": [[id, ...], ...], "starts": [k, ...]}
                                -> {"logprobs": [[lp_k, ..., lp_{n-1}], ...], "policy_version"}

The scoring route returns, for each token-id sequence, the served model's log-probability
(temperature 1) of every token from position ``starts[i]`` on given the tokens before it:
what vLLM's ``prompt_logprobs`` gives, for the given ids only, with no sampling. A
teacher for on-policy distillation (``model.teacher.url``) sends the student's prompt
and sampled response and reads the response's logprobs. Sequences run in one forward
pass per request, so the request-size limits of the completions routes apply
(``--max-prompts``, ``--max-request-tokens``, the model's context). The pass reads the
weights the server holds; a teacher server is not sent new weights.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from rlpost.models.vocab import vocab_digest
from rlpost.rollout.openai_params import APIError, parse_json_object

router = APIRouter(prefix="/v1")


@router.get("/tokenizer")
async def tokenizer_info(request: Request) -> dict:
    return vocab_digest(request.app.state.service.tokenizer)


@router.post("/prompt_logprobs")
async def prompt_logprobs(request: Request) -> dict:
    service = request.app.state.service
    body = parse_json_object(await request.body())
    vocab = service.scheduler.model.config.vocab_size
    prompts, starts = parse_scoring(body, vocab, service.settings)
    rows = await run_in_threadpool(score, service.scheduler.model, prompts, starts)
    return {"logprobs": rows, "policy_version": service.scheduler.version}


def parse_scoring(body: dict, vocab: int, settings) -> tuple[list[list[int]], list[int]]:
    """The request's sequences and start positions, checked; a 400 naming the first problem."""
    prompts, starts = body.get("prompts"), body.get("starts")
    if not isinstance(prompts, list) or not prompts:
        raise APIError(400, "prompts must be a non-empty list of token-id lists", "prompts")
    if len(prompts) > settings.max_prompts:
        raise APIError(
            400, f"{len(prompts)} prompts; this server takes at most {settings.max_prompts}",
            "prompts",
        )  # fmt: skip
    if not isinstance(starts, list) or len(starts) != len(prompts):
        raise APIError(400, "starts must be a list with one position per prompt", "starts")
    limit = settings.max_model_len
    for i, (ids, k) in enumerate(zip(prompts, starts, strict=True)):
        if not isinstance(ids, list) or not ids:
            raise APIError(400, f"prompts[{i}] must be a non-empty list of token ids", "prompts")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompts[{i}] holds a token id outside [0, {vocab})", "prompts")
        if limit is not None and len(ids) > limit:
            raise APIError(
                400, f"prompts[{i}] has {len(ids)} tokens; the model's context is {limit}",
                "prompts",
            )  # fmt: skip
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(ids):
            raise APIError(
                400, f"starts[{i}]={k!r} must be an integer in [1, {len(ids)}]", "starts"
            )
    total = sum(len(p) for p in prompts)
    if total > settings.max_request_tokens:
        raise APIError(
            400, f"{total} tokens in one request; this server takes at most "
            f"{settings.max_request_tokens}", "prompts",
        )  # fmt: skip
    return prompts, starts


def score(model, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
    """``log p(ids[t] | ids[:t])`` for ``t >= starts[i]`` of every sequence: one right-padded
    forward pass (float32 log-softmax at temperature 1)."""
    import torch

    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logp.gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1).cpu()
    return [
        picked[i, k - 1 : len(p) - 1].tolist()
        for i, (p, k) in enumerate(zip(prompts, starts, strict=True))
    ]
