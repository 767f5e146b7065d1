"""Tool calls over the OpenAI API: the official ``openai`` client against ``rlpost serve``.

The tiny model's output is noise, so the tool loop runs on a tiny model trained
here, for a few seconds, to write fixed outputs for three fixed chats: two calls
for the question, a final answer once the tools have answered, and a call with
broken JSON. What it writes is then sampled greedily by the server like any
model's output: nothing in the server is forced, only the weights are.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI

from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.rollout.serve.tool_calls import chat_turns
from tests.integration.test_server import start_server, stop_server

# A chat template in the Hermes/Qwen style, short because every character is a token.
TEMPLATE = (
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}{{ m.role[0] }}:{{ m.content }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ "\\n" }}{% endfor %}'
    "{%- if add_generation_prompt %}a:{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in ("add", "mul")
]
QUESTION = [{"role": "user", "content": "2+3 and 4*5?"}]
TWO_CALLS = (
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    '<tool_call>{"name": "mul", "arguments": {"a": 4, "b": 5}}</tool_call>'
)
BROKEN = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
IMPLEMENT = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


def _answered(calls: list[dict]) -> list[dict]:
    """The chat after the model's two calls and the tools' answers, as a client sends it."""
    answers = [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in calls]
    assistant = {"role": "assistant", "content": None, "tool_calls": [c for c, _ in calls]}
    return [*QUESTION, assistant, *answers]


def _history(name: str, args: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _train(tokenizer, model, examples: list[tuple[list[dict], str]], steps: int = 400) -> None:
    """Fit ``model`` until greedy decoding writes every example's target, then stop."""
    rows = []
    for messages, target in examples:
        turns = chat_turns(messages)
        prompt = tokenizer.apply_chat_template(turns, tools=TOOLS, add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        rows.append((prompt, tokenizer(target, add_special_tokens=False)["input_ids"] + [2]))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
        mask[i, : len(p) + len(t)] = 1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        optimizer.step()
        with torch.no_grad():  # every target token the most likely, by a wide margin
            logp = out.logits[:, :-1].log_softmax(-1)
            target, scored = labels[:, 1:], labels[:, 1:] != -100
            picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
            if (logp.argmax(-1) == target)[scored].all() and (picked[scored] > -0.1).all():
                return
    raise AssertionError(f"the tool model did not learn its outputs in {steps} steps")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny checkpoint with a tool template, trained on the tool loop's three chats."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = build_tiny_model(
        tokenizer, hidden_size=64, intermediate_size=128, max_position_embeddings=512
    )
    history = [_history("add", '{"a": 2, "b": 3}', "x"), _history("mul", '{"a": 4, "b": 5}', "y")]
    examples = [
        (QUESTION, TWO_CALLS),
        (_answered(list(zip(history, ["5", "20"], strict=True))), "5 and 20"),
        ([{"role": "user", "content": "break it"}], BROKEN),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    try:
        with torch.random.fork_rng(devices=[]):
            _train(tokenizer, model, examples)
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("tool-model") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trained(tool_model):
    proc, url = start_server(tool_model, "--max-tokens-limit", "200")
    yield url
    stop_server(proc)


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _run_calls(calls) -> list[tuple[dict, str]]:
    """The client side of a tool loop: run each call, answer with its result."""
    done = []
    for c in calls:
        result = IMPLEMENT[c.function.name](**json.loads(c.function.arguments))
        done.append((c.model_dump(exclude_none=True), str(result)))
    return done


GREEDY = {"model": "model", "temperature": 0, "max_tokens": 160, "tools": TOOLS}


def test_the_openai_client_drives_a_multi_turn_tool_loop(trained):
    client = _client(trained)
    first = client.chat.completions.create(messages=QUESTION, **GREEDY)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "add"), ("function", "mul")]
    assert [json.loads(c.function.arguments) for c in calls] == [{"a": 2, "b": 3}, {"a": 4, "b": 5}]
    assert len({c.id for c in calls}) == 2
    second = client.chat.completions.create(messages=_answered(_run_calls(calls)), **GREEDY)
    assert second.choices[0].message.content == "5 and 20"
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    # The RL fields are still there: the sampled ids are the call's text and the end token.
    raw = httpx.post(
        f"{trained}/v1/chat/completions", json={"messages": QUESTION, **GREEDY}, timeout=120
    ).json()["choices"][0]
    assert raw["token_ids"][-1] == 2 and len(raw["token_ids"]) == len(TWO_CALLS) + 1


def test_streamed_calls_accumulate_in_the_official_client(trained):
    client = _client(trained)
    whole = client.chat.completions.create(messages=QUESTION, **GREEDY).choices[0].message
    with client.chat.completions.stream(messages=QUESTION, **GREEDY) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    streamed = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert [e.name for e in deltas] == ["add", "mul"]
    # The next turn, streamed, is plain content.
    answered = _answered(_run_calls(final.message.tool_calls))
    with client.chat.completions.stream(messages=answered, **GREEDY) as stream:
        stream.until_done()  # read every chunk: the final completion is built from them
        last = stream.get_final_completion().choices[0]
    assert last.message.content == "5 and 20" and last.finish_reason == "stop"


def test_a_malformed_call_from_the_model_is_content_and_counted(trained):
    before = httpx.get(f"{trained}/health").json()["tool_calls"]["tool_parse_failures"]
    broken = [{"role": "user", "content": "break it"}]
    reply = _client(trained).chat.completions.create(messages=broken, **GREEDY).choices[0]
    assert reply.message.content == BROKEN and not reply.message.tool_calls
    assert reply.finish_reason == "stop"
    with _client(trained).chat.completions.stream(messages=broken, **GREEDY) as stream:
        stream.until_done()
        streamed = stream.get_final_completion().choices[0]
    assert streamed.message.content == BROKEN and not streamed.message.tool_calls
    after = httpx.get(f"{trained}/health").json()["tool_calls"]["tool_parse_failures"]
    assert after == before + 2


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "a second function named 'add'"),
        ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "names 'sub'"),
        ({"tool_choice": "sometimes"}, "must be auto, none, required"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "map"}}}
                ]
            },
            "type='map' is not a JSON type",
        ),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls must be true or false"),
    ],
)
def test_invalid_tools_are_a_400_naming_the_problem(trained, extra, says):
    with pytest.raises(BadRequestError) as caught:
        _client(trained).chat.completions.create(
            messages=QUESTION, **{**GREEDY, "max_tokens": 4, **extra}
        )
    error = caught.value.body
    assert says in error["message"]
    assert error["param"] in {"tools", "tool_choice", "parallel_tool_calls"}


def test_every_tool_choice_answers_calls_or_content(trained):
    """Sampled outputs on an unseen chat: whatever the model writes, a consistent 200."""
    client = _client(trained)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "mul"}}):
        body = {**GREEDY, "max_tokens": 24, "temperature": 1.0, "seed": 3, "tool_choice": choice}
        unseen = [{"role": "user", "content": "1+1?"}]
        reply = client.chat.completions.create(messages=unseen, n=4, **body)
        assert len(reply.choices) == 4
        for c in reply.choices:
            assert c.finish_reason in {"stop", "length", "tool_calls"}
            assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
            assert c.message.content is not None or c.message.tool_calls


def test_a_forced_call_opening_is_prompt_not_sample(trained):
    """A named tool_choice writes the call's opening after the generation prompt."""
    plain = {"messages": QUESTION, **GREEDY, "max_tokens": 4}
    named = {**plain, "tool_choice": {"type": "function", "function": {"name": "mul"}}}
    usage = [
        httpx.post(f"{trained}/v1/chat/completions", json=b, timeout=60).json()["usage"]
        for b in (plain, named)
    ]
    opening = '<tool_call>\n{"name": "mul", "arguments": '
    assert usage[1]["prompt_tokens"] == usage[0]["prompt_tokens"] + len(opening)
    assert usage[1]["completion_tokens"] == 4


def test_tool_messages_are_taken_back(trained):
    history = [_history("add", '{"a": 2, "b": 3}', "call_1")]
    messages = _answered([(history[0], "5")])
    r = httpx.post(
        f"{trained}/v1/chat/completions",
        json={"messages": messages, **GREEDY, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200
    bad = [*messages[:-1], {"role": "tool", "content": "5"}]
    r = httpx.post(f"{trained}/v1/chat/completions", json={"messages": bad, "max_tokens": 4})
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
