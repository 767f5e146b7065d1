"""The scoring route's arithmetic and bounds: chunked logprobs equal the one-pass ones,
the head never sees more than a chunk, a stop between chunks ends the work, and a request
whose padded logits would pass ``--max-score-entries`` is refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from rlpost.models.loading import load_policy
from rlpost.rollout.serve.openai_params import APIError, ServerSettings
from rlpost.rollout.serve.score_routes import parse_scoring, score_pieces


@pytest.fixture(scope="module")
def model():
    return load_policy(None, seed=0)[0].eval()


PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
STARTS = [2, 1, 4, 3]


def score(model, prompts, starts, chunk=0):
    """The scoring run to its end, as the scheduler runs it between decode steps."""
    pieces = score_pieces(model, prompts, starts, chunk)
    while True:
        try:
            next(pieces)
        except StopIteration as end:
            return end.value


def _reference(model, prompts, starts):
    """One sequence at a time through the full forward and log-softmax."""
    rows = []
    for p, k in zip(prompts, starts, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
        rows.append(logp.gather(-1, ids[0, 1:, None])[:, 0][k - 1 :].tolist())
    return rows


def test_chunked_scores_equal_the_full_log_softmax(model):
    want = _reference(model, PROMPTS, STARTS)
    for chunk in (1, 3, 0):
        got = score(model, PROMPTS, STARTS, chunk=chunk)
        assert [len(r) for r in got] == [len(p) - k for p, k in zip(PROMPTS, STARTS, strict=True)]
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-5)


def test_the_head_never_sees_more_than_a_chunk(model):
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[:-1].numel())
    )
    try:
        score(model, PROMPTS, STARTS, chunk=3)
    finally:
        hook.remove()
    assert seen and max(seen) <= 3
    assert sum(seen) >= sum(len(p) - 1 for p in PROMPTS)


def test_a_closed_scoring_ends_at_the_next_chunk(model):
    calls: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    pieces = score_pieces(model, PROMPTS, STARTS, chunk=2)
    try:
        while not calls:  # the pieces up to the first head chunk
            next(pieces)
        pieces.close()  # its client went away: the scheduler closes it between two steps
    finally:
        hook.remove()
    assert len(calls) == 1


def test_padded_logits_past_the_cap_are_a_400_naming_the_flag():
    settings = ServerSettings("m", max_score_entries=4 * 9 * 100 - 1)
    with pytest.raises(APIError) as exc:
        parse_scoring({"prompts": PROMPTS, "starts": STARTS}, 100, settings)
    assert exc.value.status == 400 and exc.value.param == "prompts"
    assert "--max-score-entries" in exc.value.message and "3600 logit entries" in exc.value.message
    settings = ServerSettings("m", max_score_entries=4 * 9 * 100)
    assert parse_scoring({"prompts": PROMPTS, "starts": STARTS}, 100, settings)[1] == STARTS


def test_the_vocabulary_is_hashed_once_per_server(model):
    import asyncio

    import httpx

    from rlpost.models.vocab import vocab_digest
    from rlpost.rollout.engines.scheduler import Scheduler
    from rlpost.rollout.serve.server import create_app

    tok = load_policy(None, seed=0)[1]
    want = vocab_digest(tok)
    calls, table = [], tok.get_vocab
    tok.get_vocab = lambda: calls.append(1) or table()
    app = create_app(Scheduler(model, tok), tok, ServerSettings("m"))

    async def ask() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answers = await asyncio.gather(*(client.get("/v1/tokenizer") for _ in range(4)))
            answers.append(await client.get("/v1/tokenizer"))
        return [r.json() for r in answers]

    assert asyncio.run(ask()) == [want] * 5
    assert len(calls) == 1


def test_rows_are_encoded_a_few_at_a_time_into_the_same_numbers(model):
    """The answer's JSON is built in pieces on the scheduler's thread; read back, it holds
    exactly the floats the scoring computed, and a NaN fails instead of writing bad JSON."""
    import json

    from rlpost.rollout.serve.score_routes import encoded_rows

    expected = score(model, PROMPTS, STARTS)
    pieces = encoded_rows(score_pieces(model, PROMPTS, STARTS), rows_per_piece=1)
    paused = 0
    while True:
        try:
            next(pieces)
            paused += 1
        except StopIteration as end:
            text = end.value
            break
    assert json.loads(f"[{text}]") == expected
    scoring_pauses = sum(1 for _ in score_pieces(model, PROMPTS, STARTS))
    assert paused == scoring_pauses + len(PROMPTS)  # one more pause per row encoded
    bad = encoded_rows(_returning([[0.5, float("nan")]]))
    with pytest.raises(ValueError):
        while True:
            next(bad)


def _returning(rows):
    """A generator with no pieces that returns ``rows``."""
    return rows
    yield
