"""The OpenAI request fields ``rlpost serve`` understands, checked and parsed.

Every field of a request is either implemented, accepted only at its neutral
value (``echo: false``, ``functions: []``, ``response_format: {"type": "text"}``,
``best_of`` equal to ``n``...), or refused with a 400 naming it: a client
never gets a response that silently ignored what it asked for. Bad values are
a 4xx with a one-line reason in the OpenAI error envelope.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

from rlpost.data import safe_json
from rlpost.rollout.engines.protocol import LogitAdjust, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_STOP_TEXTS = 16
MAX_LOGIT_BIAS = 1024

# Implemented on both endpoints (vLLM's names for top_k, stop_token_ids, ignore_eos and
# the return_* flags; rlpost always returns token ids). ``user`` only labels a request.
COMMON_FIELDS = set(
    "model n temperature top_p top_k max_tokens stop stop_token_ids logprobs seed ignore_eos "
    "stream stream_options presence_penalty frequency_penalty logit_bias user return_token_ids "
    "return_tokens_as_token_ids".split()
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "add_special_tokens"}
# tools, tool_choice and parallel_tool_calls are checked by rlpost.rollout.serve.tool_calls.
CHAT_FIELDS = COMMON_FIELDS | set(
    "messages max_completion_tokens top_logprobs tools tool_choice parallel_tool_calls".split()
)


def _neutral_best_of(value, body) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return value == body.get("n", 1) or (value == 1 and body.get("n") is None)


# Accepted only when they ask for nothing rlpost would have to implement.
NEUTRAL = {
    "echo": lambda v, _: v is False,
    "suffix": lambda v, _: v == "",
    "best_of": _neutral_best_of,
    "functions": lambda v, _: v == [],  # the API's older spelling of tools
    "function_call": lambda v, _: v == "none",
    "response_format": lambda v, _: v == {"type": "text"},
}
# Flags that must be JSON booleans (a string "false" would otherwise read as true).
_BOOLS = {"stream", "ignore_eos", "return_token_ids", "return_tokens_as_token_ids"}
BOOL_FIELDS = {False: _BOOLS | {"add_special_tokens"}, True: _BOOLS | {"logprobs"}}
NEUTRAL_ON = {
    "completions": {"echo", "suffix", "best_of"},
    "chat": set(NEUTRAL) - {"echo", "suffix", "best_of"},
}


class APIError(Exception):
    """A request the server refuses; ``message`` is one line."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


_SHOW = reprlib.Repr()  # Python 3.11's Repr takes no arguments
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 2, 40, 40, 40
_SHOW.maxlist = _SHOW.maxdict = 4


def shown(value: Any) -> str:
    """``repr(value)`` cut short (a client's value may be megabytes, or nested deep), ASCII."""
    return _SHOW.repr(value).encode("ascii", "backslashreplace").decode()


def name_of(key: Any) -> str:
    """A client's field name as it may appear in a message and ``param``: short, ASCII."""
    text = key if isinstance(key, str) else repr(key)
    text = text.encode("ascii", "backslashreplace").decode()
    return text if len(text) <= 40 else text[:37] + "..."


def checked_text(value: str, param: str) -> str:
    """``value`` unless it holds a lone surrogate (JSON allows ``"\\ud800"``; no tokenizer does)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            400, f"{param} holds a lone surrogate ({shown(value[exc.start])}) at {exc.start}", param
        ) from None
    return value


@dataclass
class ServerSettings:
    """Limits a request is checked against."""

    model_name: str
    max_tokens_limit: int = 512
    max_n: int = 64
    max_model_len: int | None = None
    max_prompts: int = 1024  # prompts in one /v1/completions request
    max_request_sequences: int = 1024  # prompts x n of one request
    max_request_tokens: int = 1 << 21  # prompts x n x max_tokens x (1 + top logprobs)
    max_score_entries: int = 1 << 32  # prompt_logprobs: prompts x longest x vocabulary
    weights_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    tool_parser: str = "hermes"  # the call format read from chat outputs (tool_parsers.py)


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object; a 400 for anything else (nesting bounded)."""
    try:
        body = safe_json.loads(raw)
    except safe_json.TooDeep as exc:
        raise APIError(400, f"request body: JSON {exc}") from None
    except ValueError:  # JSONDecodeError, bytes that are not UTF-8, a 5000-digit number
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def refuse_unsupported(body: dict, *, chat: bool) -> None:
    """A 400 naming the first field this server does not implement (None counts as absent)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    neutral = NEUTRAL_ON["chat" if chat else "completions"]
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for key, value in body.items():
        if value is None or key in known:
            continue
        if key in neutral:
            if NEUTRAL[key](value, body):
                continue
            raise APIError(400, f"{key}={shown(value)} is not supported by this server", key)
        field = name_of(key)
        raise APIError(400, f"{field} is not supported by this server's {endpoint}", field)
    for key in BOOL_FIELDS[chat] & body.keys():
        if body[key] is not None and not isinstance(body[key], bool):
            raise APIError(400, f"{key} must be true or false, got {shown(body[key])}", key)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, f"user must be a string, got {shown(body['user'])}", "user")
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if not body.get("stream"):
            raise APIError(400, "stream_options needs stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise APIError(400, "stream_options supports only include_usage", "stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise APIError(
                400, "stream_options.include_usage must be true or false", "stream_options"
            )


def parse_adjust(body: dict, vocab: int) -> LogitAdjust | None:
    """Presence/frequency penalties and logit_bias -> a LogitAdjust (None when all are neutral)."""
    bias = {} if body.get("logit_bias") is None else body["logit_bias"]  # {} or [] is not absent
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        why = f"logit_bias must map token ids to numbers (at most {MAX_LOGIT_BIAS})"
        raise APIError(400, why, "logit_bias")
    pairs = []
    for key, value in bias.items():
        token = ascii_int(key) if isinstance(key, str) else None
        if token is None or not 0 <= token < vocab:
            why = f"logit_bias key {shown(key)} is not a token id in [0, {vocab})"
            raise APIError(400, why, "logit_bias")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not -100 <= value <= 100:
            why = f"logit_bias[{key}]={shown(value)} must be a number in [-100, 100]"
            raise APIError(400, why, "logit_bias")
        pairs.append((token, float(value)))
    adjust = LogitAdjust(
        presence_penalty=float(_field(body, "presence_penalty", 0.0, -2, 2)),
        frequency_penalty=float(_field(body, "frequency_penalty", 0.0, -2, 2)),
        logit_bias=tuple(sorted(pairs)),
    )
    return adjust if adjust.active else None


def ascii_int(text: str, digits: int = 18) -> int | None:
    """``int(text)`` for up to ``digits`` ASCII digits, else None (``"²".isdigit()`` is True,
    and ``int`` refuses more than 4300 digits)."""
    ok = text.isascii() and text.isdigit() and len(text) <= digits
    return int(text) if ok else None


def _field(body: dict, key: str, default, low, high=math.inf, *, integer=False, low_open=False):
    """``body[key]`` checked to be a number (an integer if ``integer``) in range; ``default`` if absent."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"{key} must be {kind}, got {shown(value)}", key)
    if not integer and isinstance(value, int):
        value = float(value) if abs(value) < 1e300 else math.inf  # float() overflows beyond
    if not isinstance(value, int) and not math.isfinite(value):  # JSON allows NaN, Infinity
        raise APIError(400, f"{key} must be a finite number, got {shown(value)}", key)
    if value < low or (low_open and value == low) or value > high:
        if math.isinf(high):
            bound = f"{'>' if low_open else '>='} {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]"
        raise APIError(400, f"{key}={shown(value)} must be {bound}", key)
    return value


GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (logits / T would overflow)


def _token_list(value: Any, vocab: int, key: str) -> list[int]:
    if not isinstance(value, list):
        raise APIError(400, f"{key} must be a list of token ids, got {shown(value)}", key)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise APIError(400, f"{key} token ids must be integers", key)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{key} token id {bad[0]} is outside the vocabulary [0, {vocab})", key)
    return list(value)


def parse_prompts(
    value: Any, tokenizer, add_special_tokens: bool, limit: int | None = None
) -> list[list[int]]:
    """The prompt(s) of a completion request as token ids: text, ids, or a list of either
    (at most ``limit`` of them: each costs the server memory until it is answered)."""
    flat_ids = isinstance(value, list) and value and all(isinstance(v, int) for v in value)
    items = [value] if isinstance(value, str) or flat_ids else value
    if not isinstance(items, list) or not items:
        raise APIError(400, "prompt is missing or empty", "prompt")
    if limit is not None and len(items) > limit:
        raise APIError(
            400, f"{len(items)} prompts in one request; this server takes at most {limit}", "prompt"
        )
    prompts = []
    for item in items:
        if isinstance(item, str):
            text = checked_text(item, "prompt")
            ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        elif isinstance(item, list):
            ids = _token_list(item, len(tokenizer), "prompt")
        else:
            raise APIError(400, "prompt must be text, token ids, or a list of either", "prompt")
        if not ids:
            raise APIError(400, "prompt is empty: it must have at least one token", "prompt")
        prompts.append(ids)
    return prompts


def content_text(content: Any, i: int) -> str:
    """A message's text: a string, or OpenAI content parts that are all text parts."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return checked_text(content, where)
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", "messages")
    texts = []
    for j, part in enumerate(content):
        ok = isinstance(part, dict) and part.get("type", "text") == "text"
        if not ok or not isinstance(part.get("text"), str):
            why = f'{where}[{j}] must be a text part {{"type": "text", "text": string}}'
            raise APIError(400, f"{why}, got {shown(part)}", "messages")
        texts.append(checked_text(part["text"], f"{where}[{j}].text"))
    return "".join(texts)


def parse_sampling(body: dict, settings: ServerSettings, tokenizer, *, chat: bool) -> dict:
    """Sampling fields shared by both endpoints -> keyword arguments of GenerationRequest."""
    refuse_unsupported(body, chat=chat)
    name = settings.model_name
    if body.get("model") not in (None, name):
        why = f"model {body['model']!r} does not exist; this server serves {name!r}"
        raise APIError(404, why, "model")
    limit = settings.max_tokens_limit
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else [] if stops is None else stops
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_TEXTS
        or not all(isinstance(x, str) for x in stops)
    ):
        raise APIError(
            400, f"stop must be a string or a list of at most {MAX_STOP_TEXTS} strings", "stop"
        )
    top_k = _field(body, "top_k", -1, -1, 1 << 31, integer=True)
    temperature = _field(body, "temperature", 1.0, 0)
    stop_ids = body.get("stop_token_ids")  # null is absent; a falsy wrong type is refused
    stop_ids = [] if stop_ids is None else stop_ids
    params = SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else float(temperature),
        top_p=float(_field(body, "top_p", 1.0, 0, 1, low_open=True)),
        top_k=-1 if top_k == 0 else top_k,  # vLLM spells "no top-k" as 0 or -1
        max_tokens=_field(body, key, 16, 1, limit, integer=True),
        stop_token_ids=tuple(_token_list(stop_ids, len(tokenizer), "stop_token_ids")),
    )
    top_key = "top_logprobs" if chat else "logprobs"
    top = _field(body, top_key, 0, 0, MAX_TOP_LOGPROBS, integer=True)
    top = top if not chat or body.get("logprobs") else 0  # chat: top_logprobs needs logprobs
    return {
        "params": params,
        "n": _field(body, "n", 1, 1, settings.max_n, integer=True),
        "stop_texts": tuple(x for x in stops if x),
        "top_logprobs": top,
        "seed": _field(body, "seed", None, 0, (1 << 62), integer=True),
        "ignore_eos": body.get("ignore_eos") is True,
        "adjust": parse_adjust(body, len(tokenizer)),
    }


def check_context(prompts: list[list[int]], max_tokens: int, settings: ServerSettings) -> None:
    limit = settings.max_model_len
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_tokens > limit:
        why = f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's context"
        raise APIError(400, f"{why} of {limit} tokens", "max_tokens")


def check_work(prompts: list[list[int]], fields: dict, settings: ServerSettings) -> int:
    """The request's sequences (prompts x n); a 400 naming the limit it passes.

    Sequences bound the batch slots and memory a request holds; token entries
    (sequences x max_tokens x (1 + top logprobs)) bound the decode steps and the
    size of the response it builds."""
    n, max_tokens, top = fields["n"], fields["params"].max_tokens, fields["top_logprobs"]
    sequences = len(prompts) * n
    if sequences > settings.max_request_sequences:
        why = f"{len(prompts)} prompts x n={n} = {sequences} sequences; this server takes at most"
        why += f" {settings.max_request_sequences} in one request (--max-request-sequences)"
        raise APIError(400, why, "n")
    entries = sequences * max_tokens * (1 + top)
    if entries > settings.max_request_tokens:
        why = f"{sequences} sequences x max_tokens={max_tokens} x (1 + {top} top logprobs) = "
        why += f"{entries} token entries; this server takes at most {settings.max_request_tokens}"
        raise APIError(400, f"{why} in one request (--max-request-tokens)", "max_tokens")
    return sequences
