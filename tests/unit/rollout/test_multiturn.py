"""Multi-turn tool rollouts: token bookkeeping, masks and tool failures."""

import copy

import pytest

from rlpost.envs.formats import TagFormat
from rlpost.models.tiny import build_char_tokenizer
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.episodes.multiturn import CodeTool, MultiTurnRollout
from rlpost.types import Completion


class ScriptedPolicy:
    """Answers each turn with the next scripted text (as tokens), ending with EOS unless told not to."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.version, self.seen = tok, list(turns), 3, []

    def generate(self, prompt_ids, params, n=1, group_offset=0):
        out = []
        for i, ids in enumerate(prompt_ids):
            for _ in range(n):
                self.seen.append(list(ids))
                text = self.turns.pop(0)
                toks = self.tok(text, add_special_tokens=False)["input_ids"] + [
                    self.tok.eos_token_id
                ]
                toks = toks[: params.max_tokens]
                reason = "stop" if toks[-1] == self.tok.eos_token_id else "length"
                lps = [-0.25] * len(toks)
                out.append(Completion(list(ids), toks, lps, reason, self.version, group_offset + i))
        return out


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tool_output_is_appended_as_masked_tokens(tok):
    policy = ScriptedPolicy(tok, ["I will add. <add>2,3</add> junk after", "It is 5."])
    tools = {"add": lambda args: str(sum(int(x) for x in args.split(",")))}
    rollout = MultiTurnRollout(policy, tok, tools)
    prompt = _encode(tok, "Q: 2+3? ")
    (c,) = rollout.generate([prompt], SamplingParams(max_tokens=100), n=1, group_offset=4)
    call = "I will add. <add>2,3</add>"
    result = "<result>5</result>"
    assert c.text == call + result + "It is 5."
    n_call, n_result = len(_encode(tok, call)), len(_encode(tok, result))
    assert c.loss_mask == [1] * n_call + [0] * n_result + [1] * (
        len(c.token_ids) - n_call - n_result
    )
    assert c.logprobs[n_call : n_call + n_result] == [0.0] * n_result
    assert all(lp == -0.25 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if m)
    assert c.token_ids[-1] == tok.eos_token_id and c.finish_reason == "stop"
    assert (c.group, c.policy_version, c.prompt_ids) == (4, 3, prompt)
    # The second turn continued the exact token list, tool tokens included.
    assert policy.seen[1] == prompt + c.token_ids[: n_call + n_result]
    assert rollout.tool_calls == 1 and rollout.tool_errors == 0


def test_unknown_and_failing_tools_answer_errors(tok):
    def broken(_):
        raise ZeroDivisionError("division by zero")

    turns = ['<tool name="nope">x</tool>', '<tool name="div">1/0</tool>', "done"]
    fmt = TagFormat(call='<tool name="{name}">{arguments}</tool>')
    rollout = MultiTurnRollout(ScriptedPolicy(tok, turns), tok, {"div": broken}, fmt=fmt)
    (c,) = rollout.generate([_encode(tok, "go ")], SamplingParams(max_tokens=200))
    assert "error: unknown tool 'nope'; available: div" in c.text
    assert "error: ZeroDivisionError: division by zero" in c.text
    assert c.text.endswith("done") and rollout.tool_errors == 2


def test_budget_and_call_limit(tok):
    call = "<echo>abc</echo>"
    rollout = MultiTurnRollout(ScriptedPolicy(tok, [call] * 3), tok, {"echo": str}, max_turns=2)
    (c,) = rollout.generate([_encode(tok, "x")], SamplingParams(max_tokens=500))
    assert c.text == call + "<result>abc</result>" + call  # the second call is not executed
    assert rollout.tool_calls == 1
    tight = MultiTurnRollout(ScriptedPolicy(tok, [call]), tok, {"echo": str})
    (c,) = tight.generate([_encode(tok, "x")], SamplingParams(max_tokens=len(call) + 5))
    assert c.finish_reason == "length" and len(c.token_ids) == len(call) + 5
    assert c.loss_mask[-5:] == [0] * 5


def test_groups_of_conversations(tok):
    turns = ["a", "b", "c", "d"]
    out = MultiTurnRollout(ScriptedPolicy(tok, turns), tok, {}).generate(
        [_encode(tok, "p"), _encode(tok, "q")], SamplingParams(max_tokens=10), n=2
    )
    assert [c.group for c in out] == [0, 0, 1, 1]
    assert [c.text for c in out] == turns


@pytest.mark.sandbox
def test_code_tool_runs_in_the_sandbox():
    from rlpost.rewards.sandbox import SandboxUnavailable, check_available

    try:
        check_available()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    assert CodeTool()("print(6 * 7)").strip() == "42"
    assert "ZeroDivisionError" in CodeTool()("1 / 0")


class Steps:
    """A custom environment (loaded by ``package.module:Class``): rewards each call, answers
    its step number, and is done only when the policy says 'end'."""

    tools = ("go",)

    def reset(self, prompt):
        self.calls = 0

    def step(self, action):
        from rlpost.envs import StepResult

        if action.call is None:
            return StepResult(
                "say end" if "end" not in action.text else "", done="end" in action.text
            )
        self.calls += 1
        return StepResult(str(self.calls), reward=0.25)


def test_budgets_end_runaway_episodes_and_are_counted(tok):
    from rlpost.envs.catalog import env_factory

    make = env_factory("tests.unit.rollout.test_multiturn:Steps")
    turns = ["<go>a</go>", "<go>b</go>", "<go>c</go>"]
    rollout = MultiTurnRollout(ScriptedPolicy(tok, turns), tok, env=make, max_turns=3)
    (c,) = rollout.generate([_encode(tok, "x")], SamplingParams(max_tokens=500))
    assert c.text == "<go>a</go><result>1</result><go>b</go><result>2</result><go>c</go>"
    assert c.finish_reason == "length" and c.episode.budget == "turns"
    assert [t.reward for t in c.episode.turns if t.role == "policy"] == [0.25, 0.25, 0.0]
    assert rollout.last_stats.turn_budget == 1 and rollout.last_stats.tool_calls == 2
    assert rollout.last_stats.metrics()["agent_turns_mean"] == 3.0
    # The token budget: the second call's answer is cut where the response is full.
    tight = MultiTurnRollout(ScriptedPolicy(tok, turns), tok, env=make, max_turns=9)
    (c,) = tight.generate([_encode(tok, "x")], SamplingParams(max_tokens=14))
    assert len(c.token_ids) == 14 and c.episode.budget == "tokens"
    assert tight.last_stats.token_budget == 1 and tight.last_stats.turn_budget == 0


def test_an_answer_the_environment_refuses_gets_its_feedback(tok):
    from rlpost.envs.catalog import env_factory

    make = env_factory("tests.unit.rollout.test_multiturn:Steps")
    rollout = MultiTurnRollout(ScriptedPolicy(tok, ["maybe", "end"]), tok, env=make)
    (c,) = rollout.generate([_encode(tok, "x")], SamplingParams(max_tokens=100))
    assert c.text == "maybe<result>say end</result>end" and c.finish_reason == "stop"
    assert c.episode.answer == "end" and c.episode.tool_calls == 0  # feedback, not a tool
    assert [t.role for t in c.episode.turns] == ["policy", "env", "policy"]


def test_chat_template_episodes_append_the_templates_tool_tokens(tok):
    from rlpost.envs.catalog import env_factory
    from rlpost.envs.formats import ChatTemplateFormat

    chat = copy.deepcopy(tok)
    chat.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
    policy = ScriptedPolicy(chat, [call, "42"])
    rollout = MultiTurnRollout(policy, chat, env=env_factory("calc"), fmt=ChatTemplateFormat(chat))
    (c,) = rollout.generate([_encode(chat, "q")], SamplingParams(max_tokens=200))
    n_call = len(_encode(chat, call)) + 1  # the policy's own end-of-turn token is kept
    tool_ids = _encode(chat, "<|tool|>42</s><|assistant|>")
    assert c.token_ids[n_call : n_call + len(tool_ids)] == tool_ids
    assert c.loss_mask == [1] * n_call + [0] * len(tool_ids) + [1] * 3  # "42" + EOS
    assert c.episode.answer == "42"


def test_partial_rollout_carries_unfinished_episodes_to_the_next_step(tok):
    import pickle

    from rlpost.envs.catalog import env_factory

    make = env_factory("tests.unit.rollout.test_multiturn:Steps")
    policy = ScriptedPolicy(tok, ["end", "<go>a</go>", "end", "end"])
    rollout = MultiTurnRollout(policy, tok, env=make)
    params = SamplingParams(max_tokens=100)
    p, q, r = (_encode(tok, t) for t in ("p", "q", "r"))
    first = rollout.generate_partial([p, q], params, 1, ["P", "Q"], fraction=0.5)
    assert first.payloads == ["P"] and [c.text for c in first.completions] == ["end"]
    assert (first.carried_groups, first.carried_samples, first.done_fraction) == (1, 1, 0.5)
    state = pickle.loads(pickle.dumps(rollout.state_dict()))  # a checkpoint keeps them
    resumed = MultiTurnRollout(policy, tok, env=make)
    resumed.load_state_dict(state)
    policy.version = 4  # new weights between the steps
    second = resumed.generate_partial([r], params, 1, ["R"], fraction=0.5)
    assert second.payloads == ["Q", "R"] and second.carried_groups == 0
    q_done = second.completions[0]
    assert q_done.text == "<go>a</go><result>1</result>end" and q_done.prompt_ids == q
    assert q_done.policy_version == 3 and set(q_done.token_versions) == {3, 4}
    assert [c.group for c in second.completions] == [0, 1]
    assert resumed.last_stats.tool_calls == 1 and resumed.last_stats.episodes == 2


def test_a_calling_turn_stops_where_its_call_closes(tok):
    fmt = TagFormat()
    assert fmt.stop_texts(("calc",)) == ("</calc>",)
    assert fmt.stop_texts(("add", "mul")) == ("</add>", "</mul>")
    assert TagFormat(call="CALL {name}: {arguments}").stop_texts(("calc",)) == ()
    assert TagFormat(call="[{arguments}]").stop_texts(("calc",)) == ("]",)

    policy = ScriptedPolicy(tok, ["<add>2,3</add>", "It is 5."])
    asked = []
    generate = policy.generate
    policy.generate = lambda ids, params, n=1, group_offset=0: (
        asked.append(params.stop_texts) or generate(ids, params, n, group_offset)
    )
    rollout = MultiTurnRollout(policy, tok, {"add": lambda a: "5"})
    rollout.generate([_encode(tok, "Q: ")], SamplingParams(max_tokens=60), n=1)
    assert asked == [("</add>",), ("</add>",)]  # every turn may call, so every turn may stop


def test_a_long_tool_answer_is_cut_inside_its_wrapper(tok):
    """The output is cut to fit max_tool_tokens; the closing tag stays, so the next policy
    turn starts after the tool's message, not inside it."""
    policy = ScriptedPolicy(tok, ["<add>1,2</add>", "It is 3."])
    tools = {"add": lambda args: "y" * 300}
    rollout = MultiTurnRollout(policy, tok, tools, max_tool_tokens=20)
    (c,) = rollout.generate([_encode(tok, "Q: ")], SamplingParams(max_tokens=200))
    env = next(t for t in c.episode.turns if t.role == "env")
    assert env.end - env.start <= 20
    assert env.text.startswith("<result>y") and env.text.endswith("</result>")
    assert c.text.endswith("</result>It is 3.")


@pytest.mark.parametrize("deep", ["[" * 1500, '{"a":' * 1500], ids=["list", "object"])
def test_a_call_nested_too_deep_is_a_malformed_call(tok, deep):
    """Model output parsed as JSON is bounded: 1,500 levels would raise RecursionError."""
    from rlpost.envs.catalog import env_factory
    from rlpost.envs.formats import ChatTemplateFormat

    chat = copy.deepcopy(tok)
    chat.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    policy = ScriptedPolicy(chat, [f"<tool_call>{deep}</tool_call>", "42"])
    rollout = MultiTurnRollout(policy, chat, env=env_factory("calc"), fmt=ChatTemplateFormat(chat))
    (c,) = rollout.generate([_encode(chat, "q")], SamplingParams(max_tokens=10_000))
    assert "error: unknown tool ''" in c.text and c.episode.answer == "42"
    assert rollout.tool_calls == 1 and rollout.tool_errors == 1
