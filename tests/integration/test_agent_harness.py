"""Bring your own harness: outside agents, written against the official ``openai`` client,
run against recorded sessions of a loopback server over a real engine.

The tiny model is fitted here for a few seconds to answer every chat turn with
``<think>a</think>b``, so a template that strips earlier think blocks really rewrites
the history the next request sees.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai import BadRequestError, NotFoundError, OpenAI

from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.rewards.scorer import RewardScorer, Term, reward_samples
from rlpost.rollout.engines.continuous import ContinuousEngine
from rlpost.rollout.engines.prefix_cache import PrefixCache
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.scheduler import Scheduler
from rlpost.rollout.episodes.agent_runner import AgentRunner, HarnessSettings
from rlpost.rollout.episodes.harness_process import BASIC_ENV, STDOUT_TAIL
from rlpost.rollout.serve.sessions import SessionBounds
from rlpost.rollout.worker import to_groups
from rlpost.types import Prompt

ANSWER = "<think>a</think>b"
# Qwen3-style: an earlier assistant turn is shown without its think block.
STRIP = (
    "{%- for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}{{ '\n' }}"
    "{%- else %}A:{{ m.content.split('</think>')[-1] }}</s>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}A:{% endif %}"
)
PLAIN = STRIP.replace("{{ m.content.split('</think>')[-1] }}", "{{ m.content }}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(2,))
CHECKOUT = Path(__file__).resolve().parents[2]


def _fit(model, tokenizer, steps: int = 200) -> None:
    """Fit ``model`` to answer the first and the second turn of both templates with ANSWER."""
    tok = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = ["U:hi\nA:", "U:hi\nA:b</s>U:go\nA:", f"U:hi\nA:{ANSWER}</s>U:go\nA:"]
    rows = [(tok(p), [*tok(ANSWER), tokenizer.eos_token_id]) for p in prompts]
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-2:
            break
    model.eval()


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    _fit(model, tokenizer)
    scheduler = Scheduler(model, tokenizer, max_batch=16, prefix_cache=PrefixCache(), seed=0)
    eng = ContinuousEngine(scheduler.start(), tokenizer)
    yield eng
    eng.close()
    torch.set_num_threads(threads)


def _runner(
    engine, entry=None, *, template=PLAIN, bounds=None, command=(), grace=5.0, workers=4, env=(),
    own_user=False,
):  # fmt: skip
    # Most commands here run this test's Python, which may live where no other user can
    # run it (/root/.pyenv): they run as the trainer's user unless a test says otherwise.
    settings = HarnessSettings(
        entry, tuple(command), tuple(env), bounds or SessionBounds(4, 80, 60), workers=workers,
        chat_template=template, grace_s=grace, own_user=own_user,
    )  # fmt: skip
    return AgentRunner(engine, engine.tokenizer, settings)


def two_turns(prompt: str, base_url: str, api_key: str) -> str:
    """An agent with two chat turns, the second after the first's answer."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model="any", messages=messages, max_tokens=30)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "go"}]
    second = client.chat.completions.create(model="any", messages=messages, max_tokens=30)
    return second.choices[0].message.content


def _decode(engine, ids):
    return engine.tokenizer.decode(ids)


def test_think_stripping_template_trains_per_segment(engine):
    runner = _runner(engine, two_turns, template=STRIP)
    try:
        rows = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
        (session,) = runner.last_sessions
    finally:
        runner.close()
    first, second = session.requests
    assert _decode(engine, first.token_ids) == ANSWER + "</s>"
    # The second context shows the first answer without its think block...
    assert _decode(engine, second.prompt_ids) == "U:hi\nA:b</s>U:go\nA:"
    # ...so it is its own segment, trained on exactly that context.
    assert len(rows) == 2 and {r.group for r in rows} == {0}
    for row, rec in zip(rows, session.requests, strict=True):
        assert row.prompt_ids == rec.prompt_ids
        assert row.token_ids == rec.token_ids and row.logprobs == rec.logprobs
        assert row.loss_mask == [1] * len(rec.token_ids)
        assert row.episode.answer == ANSWER  # both judged on the session's final answer
    assert runner.last_stats.metrics()["harness_segments_mean"] == 2.0


def test_an_extending_template_is_one_interleaved_sequence(engine):
    runner = _runner(engine, two_turns, template=PLAIN)
    try:
        (row,) = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
        (session,) = runner.last_sessions
    finally:
        runner.close()
    first, second = session.requests
    added = second.prompt_ids[len(first.prompt_ids) + len(first.token_ids) :]
    assert _decode(engine, added) == "U:go\nA:"  # the template's and the user's tokens
    assert row.prompt_ids == first.prompt_ids
    assert row.token_ids == first.token_ids + added + second.token_ids
    assert row.loss_mask == [1] * len(first.token_ids) + [0] * len(added) + [1] * len(
        second.token_ids
    )
    assert row.logprobs == first.logprobs + [0.0] * len(added) + second.logprobs


def test_every_trained_logprob_is_the_record_and_the_models(engine):
    """At temperature 1 the sampled tokens vary; each trained one carries the logprob the
    server recorded, which is the model's own in that exact context."""
    runner = _runner(engine, two_turns, template=PLAIN)
    params = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(2,), seed=3)
    try:
        rows = runner.generate([[1], [1]], params, n=2, prompts=[Prompt("hi"), Prompt("yo")])
        sessions = runner.last_sessions
    finally:
        runner.close()
    assert len(rows) == 4
    model = engine.scheduler.model
    for row, session in zip(rows, sessions, strict=True):
        recorded = [lp for r in session.requests for lp in r.logprobs]
        sampled = [t for r in session.requests for t in r.token_ids]
        trained = [i for i, m in enumerate(row.loss_mask) if m]
        assert [row.token_ids[i] for i in trained] == sampled
        assert [row.logprobs[i] for i in trained] == recorded
        ids = torch.tensor([row.prompt_ids + row.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(row.prompt_ids) - 1 : -1].float()
        model_lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(row.prompt_ids) :, None])
        got = torch.tensor([row.logprobs[i] for i in trained])
        assert torch.allclose(got, model_lp[trained, 0], atol=1e-4)


def test_a_weight_update_mid_session_keeps_each_tokens_version(engine):
    model = engine.scheduler.model
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]

    def agent(prompt, base_url, api_key):
        client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=30)
        engine.load_weights(weights, version=engine.version + 1)  # the trainer's sync
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "go"}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=30)

    runner = _runner(engine, agent)
    before = engine.version
    try:
        (row,) = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
    finally:
        runner.close()
    versions = [v for v, m in zip(row.token_versions, row.loss_mask, strict=True) if m]
    assert versions[0] == before and versions[-1] == before + 1
    assert row.policy_version == before


def test_crashing_and_hanging_harnesses_are_counted_and_dropped(engine):
    release = threading.Event()

    def agent(prompt, base_url, api_key):
        if prompt == "crash":
            raise RuntimeError("the harness broke")
        if prompt == "hang":
            release.wait(120)  # never answers within the session's time
            return None
        return two_turns(prompt, base_url, api_key)

    runner = _runner(engine, agent, bounds=SessionBounds(4, 80, 0.5), grace=0.2)
    prompts = [Prompt("crash"), Prompt("hi"), Prompt("hang")]
    try:
        rows = runner.generate([[1]] * 3, GREEDY, n=1, prompts=prompts)
    finally:
        release.set()
        runner.close()
    metrics = runner.last_stats.metrics()
    assert metrics["harness_failed"] == 1.0 and metrics["harness_timed_out"] == 1.0
    assert "the harness broke" in runner.last_stats.error
    groups = to_groups(prompts, rows, 1, by_index=True)
    assert [g.n for g in groups] == [0, 1, 0]  # only the working session trains


def test_commands_that_fail_or_hang_are_counted_and_killed(engine):
    for code, counted in (("import sys; sys.exit(3)", "harness_failed"),
                          ("import time; time.sleep(120)", "harness_timed_out")):  # fmt: skip
        runner = _runner(
            engine, command=(sys.executable, "-c", code), bounds=SessionBounds(2, 40, 1.0),
            grace=0.5,
        )  # fmt: skip
        try:
            rows = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
        finally:
            runner.close()
        assert rows == [] and runner.last_stats.metrics()[counted] == 1.0


def test_the_calc_agent_as_a_command(engine):
    """rlpost/envs/examples/calc_agent.py run as a process: the official client over OPENAI_BASE_URL."""
    command = (sys.executable, str(CHECKOUT / "rlpost" / "envs" / "examples" / "calc_agent.py"))
    runner = _runner(engine, command=command, template=PLAIN + "{% if tools %}{% endif %}")
    try:
        rows = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
        (session,) = runner.last_sessions
    finally:
        runner.close()
    assert runner.last_stats.failed == 0, runner.last_stats.error
    assert len(rows) == 1 and rows[0].token_ids[: len(session.requests[0].token_ids)] == (
        session.requests[0].token_ids
    )


def test_session_bounds_and_unknown_sessions_are_4xx(engine):
    runner = _runner(engine, two_turns)
    store = runner.server.sessions
    chat = [{"role": "user", "content": "hi"}]
    try:
        one = store.open(SessionBounds(1, 80, 60), GREEDY)
        client = OpenAI(base_url=runner.base_url(one), api_key=one.key, max_retries=0)
        client.chat.completions.create(model="m", messages=chat)
        with pytest.raises(BadRequestError, match="all 1 requests are spent"):
            client.chat.completions.create(model="m", messages=chat)
        few = store.open(SessionBounds(4, 5, 60), GREEDY)
        client = OpenAI(base_url=runner.base_url(few), api_key=few.key, max_retries=0)
        reply = client.chat.completions.create(model="m", messages=chat, max_tokens=30)
        assert reply.usage.completion_tokens == 5  # cut to what the session had left
        with pytest.raises(BadRequestError, match="its 5 sampled tokens are spent"):
            client.chat.completions.create(model="m", messages=chat)
        fresh = store.open(SessionBounds(4, 80, 60), GREEDY)
        client = OpenAI(base_url=runner.base_url(fresh), api_key=fresh.key, max_retries=0)
        with pytest.raises(BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="m", messages=chat, n=2)
        with pytest.raises(BadRequestError, match="stream=true is not recorded"):
            client.chat.completions.create(model="m", messages=chat, stream=True)
        store.close(fresh.id)
        with pytest.raises(NotFoundError, match=f"session '{fresh.id}' is unknown or closed"):
            client.chat.completions.create(model="m", messages=chat)
        full = store.open(SessionBounds(4, 80, 60), GREEDY)
        client = OpenAI(base_url=runner.base_url(full), api_key=full.key, max_retries=0)
        with pytest.raises(BadRequestError, match="context"):  # the model's 128 positions
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 200}]
            )
        assert full.bound_hit == "tokens"  # a full context ends the session as truncated
        assert one.bound_hit == "requests" and few.bound_hit == "tokens"
        assert len(one.requests) == 1 and json.dumps(one.requests[0].token_versions)
    finally:
        runner.close()


# A command harness: one request on its session, then the code appended to it.
AGENT = """
import json, os, sys, httpx
prompt = sys.stdin.read()
url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
own = {"Authorization": "Bearer " + key}
body = {"prompt": "hi", "max_tokens": 2}
httpx.post(url + "/completions", json=body, headers=own, timeout=60).raise_for_status()
"""


# What a command prints last: its answer, or a reward line; valid: whether the sample may train.
LAST_LINES = [
    ("4", "4", 0.0, True),  # a number alone is an answer, judged by the reward terms
    ("1e30", "1e30", 0.0, True),
    ("inf", "inf", 0.0, True),
    ("nan", "nan", 0.0, True),
    ("reward: 0.75", None, 0.75, True),
    ("reward: -10", None, -10.0, True),
    ("reward: 1e30", None, 1e30, False),  # outside reward.score_range
    ("reward: inf", None, math.inf, False),
    ("reward: nan", None, math.nan, False),
    ("reward: 0.5x", None, math.nan, False),
]


def test_a_commands_reward_is_an_explicit_line_in_the_score_range(engine):
    runner = _runner(engine, command=(sys.executable, "-c", AGENT + "print(prompt)\n"))
    prompts = [Prompt(last) for last, *_ in LAST_LINES]
    try:
        rows = runner.generate([[1]] * len(prompts), GREEDY, n=1, prompts=prompts)
    finally:
        runner.close()
    rows = sorted(rows, key=lambda r: r.group)
    assert [r.group for r in rows] == list(range(len(LAST_LINES)))
    for row, (last, answer, reward, _) in zip(rows, LAST_LINES, strict=True):
        got = [t for t in row.episode.turns if t.role == "policy"][-1].reward
        assert got == reward or (math.isnan(got) and math.isnan(reward)), (last, got)
        assert row.episode.answer == answer if answer else row.episode.answer != last
    # The reward worker's check: such a sample scores invalid_score and is counted.
    groups = to_groups(prompts, rows, 1, by_index=True)
    scorer = RewardScorer([Term("zero", lambda s, **_: 0.0, 1.0, "rule")], invalid_score=-1.0,
                          score_range=(-10.0, 10.0))  # fmt: skip
    scored = scorer.score(reward_samples(groups, max_tokens=40))
    assert scored.invalid_rows == [i for i, (*_, valid) in enumerate(LAST_LINES) if not valid]


def test_a_command_gets_its_url_its_key_the_listed_names_and_its_prompt_on_stdin(
    engine, monkeypatch
):
    for name in ("RLPOST_ADMIN_KEY", "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("MY_TOOL_HOST", "listed")
    code = AGENT + (
        "root = url.split('/sessions/')[0]\n"
        "tried = [httpx.get(root + '/v1/sessions', headers=own).status_code,\n"
        "         httpx.post(root + '/v1/completions', json=body, headers=own).status_code]\n"
        "print(json.dumps([sorted(os.environ), len(prompt), tried]))\n"
    )
    command = (sys.executable, "-c", code)
    runner = _runner(engine, command=command, env=("MY_TOOL_HOST",))
    prompt = "p" * (200 << 10)  # past the 128 KiB an environment variable may hold
    try:
        (row,) = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt(prompt)])
    finally:
        runner.close()
    names, length, tried = json.loads(row.episode.answer)
    assert length == len(prompt)
    assert "MY_TOOL_HOST" in names and {"OPENAI_BASE_URL", "OPENAI_API_KEY"} <= set(names)
    assert not {"RLPOST_ADMIN_KEY", "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"} & set(
        names
    )
    assert all(n in BASIC_ENV or n.startswith("LC_") for n in set(names) - {
        "MY_TOOL_HOST", "OPENAI_BASE_URL", "OPENAI_API_KEY",
    })  # fmt: skip
    assert tried == [401, 401]  # its key opens its session, not the trainer's server


def test_a_session_opens_with_its_own_key_alone(engine):
    runner = _runner(engine, two_turns)
    store, url = runner.server.sessions, runner.server.url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        mine, theirs = (store.open(SessionBounds(4, 80, 60), GREEDY) for _ in range(2))
        path = f"{url}/sessions/{theirs.id}/v1/chat/completions"
        for key in (None, mine.key, "rlpost"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and "session key" in r.json()["error"]["message"]
        assert theirs.requests == [] and theirs.bound_hit is None  # nothing reached it
        ok = httpx.post(path, json=body, headers={"Authorization": f"Bearer {theirs.key}"})
        assert ok.status_code == 200 and len(theirs.requests) == 1
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60)
        assert plain.status_code == 401  # the trainer's server is keyed
        bad = httpx.post(path.replace(theirs.id, mine.id), json={**body, "max_tokens": -1},
                         headers={"Authorization": f"Bearer {mine.key}"}, timeout=60)  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    finally:
        runner.close()


def test_concurrent_requests_cannot_pass_a_sessions_bounds_together(engine):
    runner = _runner(engine, two_turns)
    store, barrier = runner.server.sessions, threading.Barrier(8)
    session = store.open(SessionBounds(1, 4, 60), GREEDY)
    path = f"{runner.server.url}/sessions/{session.id}/v1/completions"
    codes = []

    def send():
        barrier.wait()
        r = httpx.post(path, json={"prompt": "hi", "max_tokens": 30},
                       headers={"Authorization": f"Bearer {session.key}"}, timeout=120)  # fmt: skip
        codes.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        runner.close()
    assert sorted(codes) == [200] + [400] * 7
    assert len(session.requests) == 1 and session.tokens <= 4
    assert session.reserved_requests == session.reserved_tokens == 0


def test_a_sessions_clock_starts_with_its_agent(engine):
    """One worker: the second agent starts after the first has held the worker past the
    wall bound; its session still has its whole time."""
    bounds = SessionBounds(4, 80, 2.0)
    started = time.monotonic()

    def agent(prompt, base_url, api_key):
        client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        chat = [{"role": "user", "content": "hi"}]
        out = client.chat.completions.create(model="m", messages=chat, max_tokens=3)
        if prompt == "first":  # hold the only worker until the bound has passed since the start
            time.sleep(max(0.0, started + bounds.max_seconds + 0.2 - time.monotonic()))
        return out.choices[0].message.content

    runner = _runner(engine, agent, bounds=bounds, workers=1, grace=30.0)
    try:
        rows = runner.generate([[1]] * 2, GREEDY, n=1, prompts=[Prompt("first"), Prompt("then")])
    finally:
        runner.close()
    assert runner.last_stats.failed == 0, runner.last_stats.error
    assert len(rows) == 2 and all(s.bound_hit is None for s in runner.last_sessions)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


SPAWN = (
    "import subprocess, sys\n"
    "kids = [subprocess.Popen(['sleep', '300']),\n"
    "        subprocess.Popen(['sleep', '300'], start_new_session=True)]\n"
    "open(sys.argv[1], 'w').write(' '.join(str(k.pid) for k in kids))\n"
)


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_nothing_a_command_started_outlives_it(engine, ending):
    # Outside /tmp, which the command has of its own.
    pids_file = Path(tempfile.mkdtemp(prefix="rlpost-pids-", dir="/var/tmp")) / "pids"
    code = SPAWN + ("import time; time.sleep(300)\n" if ending == "timeout" else "print('done')\n")
    runner = _runner(
        engine, command=(sys.executable, "-c", code, str(pids_file)),
        bounds=SessionBounds(2, 40, 1.0), grace=1.0,
    )  # fmt: skip
    try:
        runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
        pids = [int(p) for p in pids_file.read_text().split()]
        left = [p for p in pids if _alive(p)]
    finally:
        runner.close()
        for p in [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    shutil.rmtree(pids_file.parent)
    assert len(pids) == 2 and left == []  # the background child and the setsid one
    counted = "harness_timed_out" if ending == "timeout" else "harness_failed"
    assert runner.last_stats.metrics()[counted] == 1.0  # no request sent: not trained


def test_a_commands_output_is_kept_as_a_tail_and_the_rest_counted(engine):
    big = 8 << 20
    code = AGENT + f"sys.stdout.write('x' * {big} + '\\n')\nprint('the answer')\n"
    runner = _runner(engine, command=(sys.executable, "-c", code))
    try:
        (row,) = runner.generate([[1]], GREEDY, n=1, prompts=[Prompt("hi")])
    finally:
        runner.close()
    assert row.episode.answer == "the answer"
    total = big + 1 + len("the answer\n")
    assert runner.last_stats.metrics()["harness_output_dropped_bytes"] == total - STDOUT_TAIL


# Two sessions at once: each sends its request, then tries to read the other's environment
# (where its session key is) and waits until the other has tried too.
PEEK = r"""
curl -sf -o /dev/null -H "Authorization: Bearer $OPENAI_API_KEY" \
  -H "Content-Type: application/json" -d '{"prompt": "hi", "max_tokens": 2}' \
  "$OPENAI_BASE_URL/completions" || exit 3
echo $$ > "$PEEK_DIR/pid.$$"
until [ "$(ls "$PEEK_DIR" | grep -c '^pid')" -ge 2 ]; do sleep 0.05; done
other=$(ls "$PEEK_DIR" | grep '^pid' | grep -v "^pid.$$\$" | cut -d. -f2)
seen=$(cat "/proc/$other/environ" 2>/dev/null | tr '\0' '\n' | grep -c '^OPENAI_API_KEY=')
denied=$(cat "/proc/$other/environ" 2>&1 >/dev/null | grep -c 'Permission denied')
touch "$PEEK_DIR/done.$$"
until [ "$(ls "$PEEK_DIR" | grep -c '^done')" -ge 2 ]; do sleep 0.05; done
echo "seen=$seen denied=$denied"
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("curl") is None,
    reason="needs root (to change uid) and curl",
)
@pytest.mark.parametrize(
    ("own_user", "answer"), [(True, "seen=0 denied=1"), (False, "seen=1 denied=0")]
)
def test_a_harness_cannot_read_another_sessions_key(engine, monkeypatch, own_user, answer):
    """Under a uid of its own, a harness cannot read its sibling's /proc/PID/environ (so
    not its session key); as the trainer's user it can."""
    shared = Path(tempfile.mkdtemp(prefix="rlpost-peek-", dir="/var/tmp"))  # not /tmp: their own
    shared.chmod(0o1777)  # both commands write here, whatever their uid
    monkeypatch.setenv("PEEK_DIR", str(shared))
    runner = _runner(
        engine, command=("/bin/sh", "-c", PEEK), env=("PEEK_DIR",), workers=2, own_user=own_user
    )
    try:
        rows = runner.generate([[1]], GREEDY, n=2, prompts=[Prompt("peek")])
    finally:
        runner.close()
        shutil.rmtree(shared)
    assert runner.last_stats.failed == 0, runner.last_stats.error
    assert sorted(r.episode.answer for r in rows) == [answer, answer]
