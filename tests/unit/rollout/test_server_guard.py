"""Server security and OpenAI parameters without a server: keys, paths, binds, fields, logits."""

from __future__ import annotations

import copy

import pytest
import torch

from rlpost.rollout.engines.protocol import LogitAdjust, SamplingParams, adjust_logits
from rlpost.rollout.engines.scheduler import GenerationRequest, Scheduler
from rlpost.rollout.serve.guard import (
    NO_ADMIN_KEY,
    Guard,
    GuardSettings,
    PendingBudget,
    is_admin_path,
)
from rlpost.rollout.serve.net import bind_refusal, is_loopback
from rlpost.rollout.serve.openai_params import APIError, parse_adjust, refuse_unsupported


@pytest.mark.parametrize(
    ("path", "admin"),
    [
        ("/v1/weights", False),  # no such route: weights come over /v1/sync
        ("/v1/sync/session/3", True),
        ("/v1/admin/pause", True),
        ("/v1//sync/x", True),
        ("/v1/./sync/x", True),
        ("/v1/models/../sync/x", True),
        ("/v1/completions", False),
        ("/health", False),
    ],
)
def test_admin_paths_by_prefix(path, admin):
    assert is_admin_path(path) is admin


def test_authorize_matrix():
    both = Guard(None, GuardSettings(api_key="a", admin_key="b"))
    assert both.authorize("/v1/completions", None)[0] == 401
    assert both.authorize("/v1/completions", "a") is None
    assert both.authorize("/v1/completions", "b") is None
    assert both.authorize("/v1/sync/start", None)[0] == 401
    assert both.authorize("/v1/sync/start", "a")[0] == 403
    assert both.authorize("/v1/sync/anything", "b") is None
    assert both.authorize("/docs", None)[0] == 401  # everything but /health, /metrics
    assert both.authorize("/health", None) is None
    api_only = Guard(None, GuardSettings(api_key="a"))
    assert api_only.authorize("/v1/sync/start", "a") == (403, NO_ADMIN_KEY)
    keyless = Guard(None, GuardSettings())  # the loopback default: generation open, control closed
    assert keyless.authorize("/v1/completions", None) is None
    for path in ("/v1/sessions", "/v1/sync/start", "/v1/admin/x", "/v1//sync/x"):
        assert keyless.authorize(path, None) == (403, NO_ADMIN_KEY)
        assert keyless.authorize(path, "anything") == (403, NO_ADMIN_KEY)
    admin_only = Guard(None, GuardSettings(admin_key="b"))
    assert admin_only.authorize("/v1/completions", None) is None
    assert admin_only.authorize("/v1/sync/start", "b") is None
    assert admin_only.authorize("/v1/sync/start", None)[0] == 401
    assert "s3cr3t" not in repr(GuardSettings(api_key="s3cr3t", admin_key="s3cr3t2"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_binds_need_no_keys(host):
    assert is_loopback(host) and bind_refusal(host, None, None, insecure=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "no-such-host.invalid"])
def test_other_binds_need_both_keys(host):
    line = bind_refusal(host, None, None, insecure=False)
    assert "--api-key and --admin-key" in line and "\n" not in line
    assert "--admin-key" in bind_refusal(host, "k", None, insecure=False)
    assert bind_refusal(host, "k", "j", insecure=False) is None
    assert bind_refusal(host, None, None, insecure=True) is None
    assert "must differ" in bind_refusal(host, "k", "k", insecure=False)


def test_unknown_fields_are_named_and_neutral_ones_pass():
    with pytest.raises(APIError) as err:
        refuse_unsupported({"prompt": "x", "repetition_penalty": 1.2}, chat=False)
    assert err.value.param == "repetition_penalty" and "repetition_penalty" in err.value.message
    with pytest.raises(APIError, match="messages"):  # a chat field on the completions endpoint
        refuse_unsupported({"prompt": "x", "messages": []}, chat=False)
    refuse_unsupported(
        {"tools": [], "tool_choice": None, "response_format": {"type": "text"}}, chat=True
    )
    refuse_unsupported({"n": 3, "best_of": 3, "echo": False}, chat=False)
    with pytest.raises(APIError, match="best_of"):
        refuse_unsupported({"n": 2, "best_of": 4}, chat=False)


def test_parse_adjust():
    assert parse_adjust({}, 10) is None
    adjust = parse_adjust({"logit_bias": {"3": -100, "1": 2.5}, "presence_penalty": 0.5}, 10)
    assert adjust.logit_bias == ((1, 2.5), (3, -100.0)) and adjust.presence_penalty == 0.5
    for bad in ({"logit_bias": {"10": 1}}, {"logit_bias": {"x": 1}}, {"logit_bias": {"1": 101}}):
        with pytest.raises(APIError):
            parse_adjust(bad, 10)


def test_adjust_logits_by_hand():
    logits = torch.zeros(5)
    out = adjust_logits(logits, [1, 1, 2], LogitAdjust(0.5, 0.25, ((4, 3.0),)))
    # token 1: twice (0.5 + 2 * 0.25), token 2: once (0.5 + 0.25), token 4: +3
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 3.0]
    assert logits.tolist() == [0.0] * 5  # the input is left alone


def test_defaults_leave_sampling_bit_identical(tiny):
    """adjust=None, an inactive LogitAdjust and a token callback draw the very same samples."""
    model, tok = tiny
    prompt = tok("1+2=", add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    events = []
    variants = [{}, {"adjust": LogitAdjust()}, {"on_token": events.append}]
    outs = []
    for extra in variants:
        sched = Scheduler(copy.deepcopy(model), tok, seed=0).start()
        outs.append(sched.submit(GenerationRequest(prompt, params, n=3, **extra)).future.result(60))
        sched.stop()
    for other in outs[1:]:
        assert [o.token_ids for o in other] == [o.token_ids for o in outs[0]]
        assert [o.logprobs for o in other] == [o.logprobs for o in outs[0]]  # bit for bit
    for i, out in enumerate(outs[2]):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == out.token_ids
        assert [e.finish for e in mine] == [None] * (len(mine) - 1) + [out.finish_reason]


def test_a_vanishing_temperature_samples_greedily(tiny):
    from rlpost.rollout.serve.openai_params import ServerSettings, parse_sampling

    def temperature(value: float) -> float:
        fields = parse_sampling({"temperature": value}, ServerSettings("m"), tiny[1], chat=False)
        return fields["params"].temperature

    assert temperature(1e-45) == 0.0 and temperature(0.0) == 0.0  # logits / T would overflow
    assert temperature(0.7) == 0.7


def test_pending_is_counted_in_sequences_and_refused_past_the_bound():
    stats: dict = {}
    budget = PendingBudget(10, stats, retry_after_s=3)
    budget.take(6)  # one request of 2 prompts x n 3
    budget.take(4)
    assert stats["pending"] == 10
    with pytest.raises(APIError) as full:
        budget.take(1)
    assert full.value.status == 429 and full.value.headers == {"retry-after": "3"}
    assert "10 of 10 sequences pending" in full.value.message and stats["pending"] == 10
    budget.release(6)
    budget.take(5)
    budget.release(5)
    budget.release(4)
    assert stats["pending"] == 0
    budget.take(25)  # an idle server takes any request the work caps let through
    assert stats["pending"] == 25
