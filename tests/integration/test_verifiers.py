"""verifiers environments through rlpost: the data source, the rubric reward, the episode
environment, and what cannot be had offline (extra [verifiers], in the test extra)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

vf = pytest.importorskip(
    "verifiers", reason="the verifiers adapters need pip install 'rlpost[verifiers]'"
)

from rlpost.config import VerifiersSourceConfig, load_config  # noqa: E402
from rlpost.data.verifiers_source import VerifiersError, env_splits, load_env  # noqa: E402
from rlpost.envs.base import Action, EnvError, ToolCall  # noqa: E402
from rlpost.envs.verifiers_env import VerifiersEnv  # noqa: E402
from rlpost.pipeline.loop import train  # noqa: E402
from rlpost.rewards.verifiers_rubric import VerifiersRubric  # noqa: E402
from rlpost.types import Episode, RewardSample, Turn  # noqa: E402
from tests.conftest import small_overrides  # noqa: E402

ARITH = "rlpost.envs.examples.verifiers_arith:load_environment"
HELPERS = "tests.integration.verifiers_envs"


def _own_score(env, prompt, completion: str) -> tuple[float, dict]:
    """verifiers' own Rubric.score_rollout on a state made by the environment's init_state."""
    from verifiers.types import AssistantMessage

    from rlpost.data.verifiers_source import _no_model_client

    async def go():
        state = await env.init_state(
            prompt.metadata["verifiers"]["input"], _no_model_client(vf), "m"
        )
        reply = [AssistantMessage(content=completion)]
        state["completion"] = reply
        state["trajectory"] = [{"prompt": state["prompt"], "completion": reply}]
        await env.rubric.score_rollout(state)
        return state["reward"], state["metrics"]

    return asyncio.run(go())


def _samples(prompts, completions) -> list[RewardSample]:
    return [
        RewardSample(prompt=p.text, completion=c, answer=p.answer, metadata=p.metadata)
        for p in prompts
        for c in completions(p)
    ]


def test_rubric_scores_equal_verifiers_own_score_rollout():
    env = load_env(ARITH)
    train_rows, held_out, _, info = env_splits(VerifiersSourceConfig(env=ARITH, train_size=5))
    assert info["class"] == "SingleTurnEnv" and len(train_rows) == 5 and len(held_out) == 64
    assert train_rows[0].text == env.dataset[0]["question"]
    assert train_rows[0].answer == env.dataset[0]["answer"]
    replies = lambda p: [p.answer, f"{p.answer}!", "7", ""]  # noqa: E731
    samples = _samples(train_rows, replies)
    scorer = VerifiersRubric(env=ARITH)
    got = scorer.score(samples)
    for i, s in enumerate(samples):
        reward, metrics = _own_score(env, train_rows[i // 4], s.completion)
        assert got[i] == pytest.approx(reward)
        for name, value in metrics.items():
            assert scorer.last_components[name][i] == pytest.approx(value)
    # right answers: both functions (1.0 + 0.2); a number that is wrong: the format one
    assert got[0] == pytest.approx(1.2) and got[1] == 0.0
    assert {"exact_match", "digits_only", "num_turns"} <= set(scorer.last_components)


def test_group_reward_functions_see_each_prompts_group():
    scorer = VerifiersRubric(env=f"{HELPERS}:load_grouped")
    rows, _, _, _ = env_splits(VerifiersSourceConfig(env=f"{HELPERS}:load_grouped", train_size=2))
    # the two prompts interleaved: groups come from the prompt, not from the batch order
    samples = _samples(rows, lambda p: [p.answer, p.answer + "00"])
    samples = [samples[0], samples[2], samples[1], samples[3]]
    got = scorer.score(samples)
    assert got == pytest.approx([1.5, 1.5, 0.0, 0.0])
    assert scorer.last_components["group_rank"] == [1.0, 1.0, 0.0, 0.0]


def test_rubric_and_task_rewards_by_name():
    rubric = VerifiersRubric(rubric=f"{HELPERS}:arith_rubric")
    samples = [RewardSample(prompt="1+2=", completion=c, answer="3") for c in ("3", "4")]
    assert rubric.score(samples) == [2.0, 0.0]
    task = VerifiersRubric(task=f"{HELPERS}:SumTask")
    samples = [RewardSample(prompt="1+2=", completion=c, answer="3") for c in ("3", "33", "1234")]
    assert task.score(samples) == [1.25, 0.25, 0.0]  # correct (weight 1) + short (weight 0.25)
    assert task.last_components["reply_chars"] == [1.0, 2.0, 4.0]  # a metric: recorded, unsummed
    with pytest.raises(ValueError, match="exactly one of env, rubric or task"):
        VerifiersRubric(env=ARITH, rubric=f"{HELPERS}:arith_rubric")


def test_tool_env_episode_calls_its_python_tools():
    env = VerifiersEnv(env=ARITH, env_args={"tools": True})
    assert env.tools == ("calculator",)
    rows, _, _, _ = env_splits(VerifiersSourceConfig(env=ARITH, env_args={"tools": True}))
    env.reset(rows[0])
    got = env.step(Action("<calculator>12+12</calculator>", ToolCall("calculator", "12+12")))
    assert (got.observation, got.done) == ("24", False)
    assert env.step(Action("24")).done  # no call: ToolEnv's own no_tools_called
    assert env.state["stop_condition"] == "no_tools_called"
    # the transcript is what verifiers would score: an assistant call, the tool's answer
    assert [m.role for m in env.messages] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(env.messages[1].tool_calls[0].arguments) == {"expression": "12+12"}
    env.reset(rows[0])
    got = env.step(Action("", ToolCall("calculator", '{"expression": "30-4"}')))  # JSON object
    assert got.observation == "26"
    got = env.step(Action("", ToolCall("calculator", "3*4")))  # the tool raises: its message
    assert "cannot read" in got.observation and not got.done
    assert env.step(Action("", ToolCall("calculator", "1+1"))).done  # its max_turns=3
    assert env.state["stop_condition"] == "max_turns_reached"


def test_multiturn_env_feedback_and_stop_conditions():
    env = VerifiersEnv(env=f"{HELPERS}:load_guess", env_args={"max_turns": 3})
    assert env.tools == ()
    rows, _, _, _ = env_splits(VerifiersSourceConfig(env=f"{HELPERS}:load_guess"))
    env.reset(rows[2])  # 2+3=, answer 5
    assert env.step(Action("1")).observation == "higher"
    assert env.step(Action("9")).observation == "lower"
    assert env.step(Action("5")).done  # its own @vf.stop
    assert env.state["guesses"] == 2
    env.reset(rows[2])
    for guess in ("1", "2"):
        assert not env.step(Action(guess)).done
    assert env.step(Action("3")).done  # max_turns=3


def test_episode_environment_survives_pickling():
    import pickle

    env = VerifiersEnv(env=f"{HELPERS}:load_guess")
    rows, _, _, _ = env_splits(VerifiersSourceConfig(env=f"{HELPERS}:load_guess"))
    env.reset(rows[2])
    env.step(Action("1"))
    back = pickle.loads(pickle.dumps(env))
    assert back.step(Action("9")).observation == "lower"
    assert back.state["guesses"] == 2 and back.step(Action("5")).done


def _train(tmp_path, env_args: dict, **extra):
    sources = [{"name": "vf", "task": {"name": "verifiers", "env": ARITH, "env_args": env_args}}]
    terms = [{"name": "verifiers_rubric", "env": ARITH, "env_args": env_args}]
    over = {
        "data.sources": json.dumps(sources),
        "reward.terms": json.dumps(terms),
        "sft.steps": 30,
        "rollout.max_tokens": 4,
        "eval.every": 0,
        "checkpoint.every": 0,
        "reward.sample_every": 1,
        "reward.sample_count": 64,
        "rollout.truncated_reward": "null",  # every sample scored by the rubric, truncated or not
        **extra,
    }
    cfg = load_config(None, small_overrides(tmp_path, **over))
    seen = {}
    result = train(cfg, on_groups=lambda step, groups: seen.update({step: groups}))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, seen, [r for r in rows if "loss" in r]


def test_single_turn_env_trains_on_its_rubric(tmp_path):
    env = load_env(ARITH)
    result, seen, steps = _train(tmp_path, {}, **{"train.steps": 3})
    assert len(steps) == 3 and sorted(seen) == [1, 2, 3]
    for row in steps:
        groups = seen[row["step"]]
        scores = []
        for g in groups:
            for c, score in zip(g.completions, g.scores, strict=True):
                reward, _ = _own_score(env, g.prompt, c.text)
                assert score == pytest.approx(reward)
                scores.append(reward)
        assert row["reward_mean"] == pytest.approx(sum(scores) / len(scores))
        assert row["reward/verifiers_rubric"] == pytest.approx(row["reward_mean"])
        assert "reward/verifiers_rubric/exact_match" in row
        logged = (result.run_dir / "samples" / f"step_{row['step']}.jsonl").read_text()
        for record in map(json.loads, logged.splitlines()):  # the logged samples, rescored
            prompt = next(g.prompt for g in groups if g.prompt.text == record["prompt"])
            reward, metrics = _own_score(env, prompt, record["completion"])
            assert record["score"] == pytest.approx(reward)
            assert record["components"]["verifiers_rubric/digits_only"] == metrics["digits_only"]


def test_tool_env_trains_through_the_episode_loop(tmp_path):
    args = {"tools": True}
    over = {
        "agent.env": json.dumps({"name": "verifiers", "env": ARITH, "env_args": args}),
        "agent.max_turns": 3,
        "rollout.max_tokens": 24,
        "train.steps": 2,
    }
    _, seen, steps = _train(tmp_path, args, **over)
    assert len(steps) == 2
    episodes = [c for g in seen[2] for c in g.completions]
    assert all(c.episode is not None for c in episodes)
    for g in seen[2]:  # the rubric judges the final turn: exact match 1.0 + digits only 0.2
        for c, score in zip(g.completions, g.scores, strict=True):
            reply = c.episode.answer.strip()
            expected = (reply == g.prompt.answer) * 1.0 + reply.isdigit() * 0.2
            assert score == pytest.approx(expected)


def test_episode_scored_as_its_messages():
    scorer = VerifiersRubric(env=ARITH, env_args={"tools": True})
    rows, _, _, _ = env_splits(VerifiersSourceConfig(env=ARITH, env_args={"tools": True}))
    p = rows[0]
    turns = [
        Turn(
            "policy", 0, 5, "calculator", text="<calculator>12+12</calculator>", arguments="12+12"
        ),
        Turn("env", 5, 8, text="<result>24</result>"),
        Turn("policy", 8, 10, text=p.answer),
    ]
    sample = RewardSample(
        prompt=p.text,
        completion=p.answer,
        answer=p.answer,
        metadata=p.metadata,
        episode=Episode(turns, p.answer),
    )
    assert scorer.score([sample]) == [pytest.approx(1.2)]
    parts = scorer.last_components
    assert parts["calculator_calls"] == [1.0] and parts["total_tool_calls"] == [1.0]
    assert parts["num_turns"] == [2.0]
    state = scorer.state(sample)
    call = state["completion"][0].tool_calls[0]
    assert json.loads(call.arguments) == {"expression": "12+12"}
    assert state["completion"][1].role == "tool"


def test_what_cannot_be_had_offline_is_one_line(monkeypatch):
    import datasets
    import huggingface_hub.constants as hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(VerifiersError) as hub_error:
        load_env(f"{HELPERS}:load_from_hub")
    line = str(hub_error.value)
    assert (
        "\n" not in line and "needs a download" in line and "rlpost-tests/no-such-dataset" in line
    )
    with pytest.raises(VerifiersError, match=r"module 'vf_no_such_env' is not installed; install"):
        load_env("vf-no-such-env")
    with pytest.raises(EnvError, match="is not installed"):
        VerifiersEnv(env="vf-no-such-env")
    with pytest.raises(ValueError, match="needs a download"):
        VerifiersRubric(env=f"{HELPERS}:load_from_hub")
    with pytest.raises(VerifiersError, match=r"first row cannot start a rollout .*task payloads"):
        env_splits(VerifiersSourceConfig(env=f"{HELPERS}:load_string_task"))


def test_a_bad_source_stops_the_run_in_one_line(tmp_path):
    from rlpost.config import ConfigError

    sources = [{"name": "vf", "task": {"name": "verifiers", "env": "vf-no-such-env"}}]
    cfg = load_config(None, small_overrides(tmp_path, **{"data.sources": json.dumps(sources)}))
    with pytest.raises(
        ConfigError, match=r"data.sources\[vf\].task: verifiers env 'vf-no-such-env'"
    ):
        train(cfg)


def test_another_api_generation_is_refused(tmp_path):
    # verifiers 0.4.0's package root, as it ships: the Task API only (verifiers.v1)
    pkg = tmp_path / "verifiers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "0.4.0"\n')
    code = (
        "from rlpost.data.verifiers_source import classic, VerifiersError\n"
        "try:\n    classic()\nexcept VerifiersError as e:\n    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.startswith("verifiers 0.4.0 has no classic API"), out.stderr[-500:]
    assert "verifiers==0.3.1" in out.stdout and "task=package.module:Class" in out.stdout


def test_verifiers_own_evaluate_against_rlpost_serve_scores_as_the_adapter(tiny_dir):
    """verifiers runs its own rollouts against `rlpost serve` (its OpenAI chat client) and
    scores them; the adapter, given the same completions, gives the same rewards and metrics."""
    from openai import AsyncOpenAI

    from tests.integration.test_server import start_server, stop_server

    env = load_env(ARITH)
    _, held_out, _, _ = env_splits(VerifiersSourceConfig(env=ARITH))
    rows = {p.uid: p for p in held_out}
    proc, url = start_server(tiny_dir)
    try:
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        )
        args = {"max_tokens": 1, "temperature": 1.0}  # one character: a digit one time in ten
        out = asyncio.run(
            env.evaluate(
                client,
                model="model",
                sampling_args=args,
                num_examples=64,
                rollouts_per_example=2,
                on_progress=lambda *a: None,
            )
        )["outputs"]
    finally:
        stop_server(proc)
    assert len(out) == 128
    out = [o for o in out if o["error"] is None]  # (an end-of-text first: verifiers' own error)
    assert len(out) > 100
    samples = []
    for o in out:
        p = rows[str(o["example_id"])]
        reply = o["completion"][-1].content
        samples.append(
            RewardSample(prompt=p.text, completion=reply, answer=p.answer, metadata=p.metadata)
        )
    scorer = VerifiersRubric(env=ARITH)
    assert scorer.score(samples) == pytest.approx([o["reward"] for o in out])
    for name in ("exact_match", "digits_only", "num_turns"):
        assert scorer.last_components[name] == pytest.approx([o["metrics"][name] for o in out])
    assert any(o["metrics"]["digits_only"] == 1.0 for o in out)  # not only zeros compared
