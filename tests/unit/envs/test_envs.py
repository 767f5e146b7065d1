"""Environments: the protocol contract of every built-in, each one's behaviour, the registry."""

import inspect
import random

import pytest

from rlpost.config import EnvChoice
from rlpost.envs import ENVS, Action, EnvError, StepResult, ToolCall
from rlpost.envs.calculator import calculate
from rlpost.envs.catalog import env_factory, load_env_class
from rlpost.envs.countdown import solve
from rlpost.envs.formats import (
    ChatTemplateFormat,
    TagFormat,
    build_format,
    demonstration_completion,
)
from rlpost.models.tiny import build_char_tokenizer
from rlpost.params import variants
from rlpost.types import Prompt

ARITH = Prompt("347*829=", 347 * 829, {"task": "arith"}, "347*829")
COUNTDOWN = Prompt("Use 3 5 7 to make 22:", 22, {"numbers": [3, 5, 7], "target": 22})
CODE = Prompt("f(x)=2*x+1:", "def f(x): return 2*x+1", {"tests": ["assert f(1) == 3"]})


@pytest.mark.parametrize("name", ["calc", "countdown", "python"])
def test_every_builtin_keeps_the_contract(name):
    """A fresh environment per episode; an answer (no call) ends it; a call to an unusable
    argument answers an error without raising."""
    make = env_factory(name)
    env = make()
    assert env is not make() and isinstance(env.tools, tuple) and env.tools
    prompt = {"calc": ARITH, "countdown": COUNTDOWN, "python": CODE}[name]
    env.reset(prompt)
    done = env.step(Action("the answer"))
    assert isinstance(done, StepResult) and done.done
    if name != "python":  # the sandboxed one is exercised in its own test
        env.reset(prompt)
        bad = env.step(Action("x", ToolCall(env.tools[0], "import os")))
        assert bad.error and bad.observation.startswith("error:") and not bad.done


def test_each_environment_takes_its_variants_parameters():
    """``agent.env``'s variant of each registered environment lists the constructor's keywords
    with the same defaults (a knob of the config is one the environment reads)."""
    by_name = variants(EnvChoice)
    assert sorted(by_name) == sorted(["none", *ENVS.names()])
    for name in ENVS.names():
        sig = inspect.signature(ENVS.get(name).__init__).parameters.values()
        keywords = {p.name: p.default for p in sig if p.name != "self"}
        assert by_name[name]().params() == keywords, name


def countdown_problems(count: int, *, size: int = 3, high: int = 20, seed: int = 0) -> list[Prompt]:
    """``count`` solvable problems: ``size`` numbers in 1..high and a target reachable from them."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        numbers = [rng.randint(1, high) for _ in range(size)]
        a, b, c = numbers[:3]
        target = rng.choice([a + b + c, a * b - c, (a + b) * c, a * b + c])
        if target <= 0 or solve(numbers, target) is None:
            continue
        text = f"Use {' '.join(map(str, numbers))} to make {target}:"
        meta = {"task": "countdown", "numbers": numbers, "target": target}
        out.append(Prompt(text, target, meta, uid=f"{numbers}->{target}"))
    return out


def test_calculator_answers_values_and_refuses_code():
    env = env_factory("calc")()
    env.reset(ARITH)
    assert env.step(Action("", ToolCall("calc", "347*829"))).observation == "287663"
    assert env.step(Action("", ToolCall("calc", "(7+1)/4"))).observation == "2"
    assert calculate("-3*-2") == 6
    for text, why in [
        ("__import__('os')", "unsupported"),
        ("2**99999", "unsupported"),
        ("1/0", "division by zero"),
        ("9" * 40 + "*" + "9" * 40, "too large"),
        ("1+", "not an arithmetic"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculate(text)


def test_countdown_checks_each_step_and_rewards_legal_ones():
    env = env_factory("countdown", {"step_reward": 0.1, "error_penalty": 0.2})()
    env.reset(COUNTDOWN)
    ok = env.step(Action("", ToolCall("step", "3*5")))
    assert ok.observation == "15; numbers: 7 15" and ok.reward == 0.1 and not ok.error
    again = env.step(Action("", ToolCall("step", "3+7")))  # 3 was used up
    assert again.error and again.reward == -0.2 and "3 is not available" in again.observation
    odd = env.step(Action("", ToolCall("step", "15/7")))
    assert odd.error and "whole number" in odd.observation
    last = env.step(Action("", ToolCall("step", "15+7")))
    assert last.observation == "22 (target reached); numbers: 22"
    steps, expression = solve([3, 5, 7], 22)
    assert len(steps) == 2 and eval(expression) == 22
    problems = countdown_problems(5, seed=1)
    assert len(problems) == 5 and all(solve(p.metadata["numbers"], p.answer) for p in problems)


@pytest.mark.sandbox
def test_python_runs_in_the_sandbox_with_test_results_as_feedback():
    from rlpost.rewards.sandbox import SandboxUnavailable, check_available

    try:
        check_available()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    env = env_factory("python")()
    env.reset(CODE)
    good = env.step(Action("", ToolCall("python", "def f(x): return 2*x+1")))
    assert good.observation == "passed 1/1 tests" and not good.error
    bad = env.step(Action("", ToolCall("python", "def f(x): return 1/0")))
    assert bad.error and bad.observation.startswith("passed 0/1 tests; ")
    assert "ZeroDivisionError" in bad.observation
    env.reset(Prompt("free"))  # no tests: the program's output
    assert env.step(Action("", ToolCall("python", "print(6*7)"))).observation == "42"


def test_bad_names_and_parameters_fail_in_one_line():
    with pytest.raises(EnvError, match=r"unknown environment 'calcc'; valid: calc, countdown"):
        load_env_class("calcc")
    with pytest.raises(EnvError, match="cannot import 'no_such_module'"):
        load_env_class("no_such_module:Env")
    with pytest.raises(EnvError, match="has no 'Nope'"):
        load_env_class("rlpost.envs.calculator:Nope")
    with pytest.raises(EnvError, match=r"environment 'calc': bad parameters \['bogus'\]"):
        env_factory("calc", {"bogus": 1})
    assert load_env_class("rlpost.envs.calculator:Calculator") is ENVS.get("calc")


def test_tag_format_finds_only_the_environments_tools():
    fmt = TagFormat()
    assert fmt.find_call("x <answer>3</answer>", ("calc",)) is None
    end, call = fmt.find_call("ok <calc>2*3</calc> tail", ("calc",))
    assert call == ToolCall("calc", "2*3") and "ok <calc>2*3</calc>"[end - 1] == ">"
    single = TagFormat(call="[[{arguments}]]", result="=> {output}")
    assert single.find_call("[[1+1]]", ("calc",))[1] == ToolCall("calc", "1+1")
    with pytest.raises(EnvError, match=r"has no \{name\}"):
        single.find_call("[[1]]", ("a", "b"))
    with pytest.raises(EnvError, match="exactly once"):
        TagFormat(call="<{name}></{name}>")


CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|tool|>{{ m['content'] }}</s>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_template_format_uses_the_templates_tool_message():
    tok = build_char_tokenizer()
    with pytest.raises(EnvError, match="has no chat template"):
        ChatTemplateFormat(tok)
    tok.chat_template = CHAT_TEMPLATE
    fmt = ChatTemplateFormat(tok)
    text = '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
    assert fmt.find_call(text, ("calc",))[1] == ToolCall("calc", "2*3")
    assert fmt.find_call("<tool_call>{oops</tool_call>", ("calc",))[1].name == ""
    # The model's turn ends with its own </s>; the tokens after it are the template's.
    assert fmt.observation_text("6") == "<|tool|>6</s><|assistant|>"
    # auto: the template's format where prompts use the template, else plain tags.
    assert isinstance(
        build_format("auto", tok, call="<{name}>{arguments}</{name}>", result="<r>{output}</r>"),
        ChatTemplateFormat,
    )
    plain = build_format(
        "auto",
        tok,
        call="<{name}>{arguments}</{name}>",
        result="<r>{output}</r>",
        chat_prompts=False,
    )
    assert isinstance(plain, TagFormat)
    assert isinstance(
        build_format(
            "auto",
            build_char_tokenizer(),
            call="<{name}>{arguments}</{name}>",
            result="<r>{output}</r>",
        ),
        TagFormat,
    )


def test_demonstrations_mask_the_environments_output():
    tok = build_char_tokenizer()
    fmt = TagFormat()
    c = demonstration_completion(env_factory("calc")(), ARITH, fmt, tok, random.Random(0))
    text = tok.decode(c.token_ids, skip_special_tokens=True)
    assert text == "<calc>347*829</calc><result>287663</result>287663"
    trained = tok.decode(
        [t for t, m in zip(c.token_ids, c.loss_mask, strict=True) if m], skip_special_tokens=True
    )
    assert trained == "<calc>347*829</calc>287663" and c.token_ids[-1] == tok.eos_token_id
    direct = demonstration_completion(
        env_factory("calc")(), ARITH, fmt, tok, random.Random(0), direct=True
    )
    assert tok.decode(direct.token_ids, skip_special_tokens=True) == "287663"
    steps = demonstration_completion(
        env_factory("countdown")(), COUNTDOWN, fmt, tok, random.Random(0)
    )
    assert "<step>" in tok.decode(steps.token_ids) and "<answer>" in tok.decode(steps.token_ids)


def test_python_demonstration_states_its_observation_without_a_sandbox_run():
    tok = build_char_tokenizer()
    env = env_factory("python")()
    c = demonstration_completion(env, CODE, TagFormat(), tok, random.Random(0))
    text = tok.decode(c.token_ids, skip_special_tokens=True)
    call = "<python>def f(x): return 2*x+1</python>"
    assert text == call + "<result>passed 1/1 tests</result>def f(x): return 2*x+1"


def test_a_run_with_a_bad_environment_is_refused_before_any_work(tmp_path, capsys):
    from rlpost.cli import main

    for over, why in [
        ("agent.env=calcc", "config agent.env.name='calcc': not one of none, calc, countdown"),
        ("agent.env.bogus=1", "unknown config key 'agent.env.bogus'"),
        (
            "agent.env.step_reward=1",
            "agent.env.name=calc has no step_reward; it is a parameter of countdown",
        ),
        ("agent.params.call_reward=1", "write agent.env.call_reward=1"),
        ("agent.env={name: python, sandbox: {timeout: 3}}", "config agent.env: python sandbox="),
    ]:
        assert main(["train", "agent_calc", f"run.output_dir={tmp_path}", over]) != 0
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())  # refused before any work: nothing was written


@pytest.mark.parametrize(
    ("sandbox", "named"), [({"timeout": 3}, "timeout"), ({"memory_mb": 10}, "memory_mb=10")]
)
def test_python_env_refuses_a_bad_sandbox_at_load(sandbox, named):
    with pytest.raises(EnvError) as err:
        env_factory("python", {"sandbox": sandbox})
    assert named in str(err.value) and "\n" not in str(err.value)


class TwoTools:
    """An environment with two tools (a custom one, loaded by path)."""

    tools = ("add", "mul")

    def reset(self, prompt):
        """Nothing to remember between episodes."""

    def step(self, action):
        return StepResult(done=True)


def test_a_call_template_that_cannot_name_the_tools_is_refused_at_load(tmp_path):
    from rlpost.config import ConfigError, load_config
    from rlpost.pipeline.rules import check as check_names

    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "agent.env=tests.unit.envs.test_envs:TwoTools",
            "agent.format=tags",
            "agent.call_template=<call>{arguments}</call>",
        ],
    )
    with pytest.raises(ConfigError, match=r"has no \{name\} but the environment has 2 tools"):
        check_names(cfg)


def test_an_environment_without_tools_never_sees_a_call():
    tags = TagFormat()
    tags.check(())
    assert tags.find_call("<>x</> <add>1</add>", ()) is None
