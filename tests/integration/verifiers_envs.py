"""Environments and tasks written against verifiers' own APIs, for the adapters' tests."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _rows(n: int = 6) -> list[dict]:
    return [{"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(n)]


class CountdownGuess(vf.MultiTurnEnv):
    """Guess the sum; a wrong guess is answered 'higher' or 'lower' by a user message, a
    right one stops the episode (its own @vf.stop condition)."""

    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1].content or "").strip()
        state["guesses"] = state.get("guesses", 0) + 1
        target = int(state["answer"])
        hint = "higher" if not guess.isdigit() or int(guess) < target else "lower"
        return [{"role": "user", "content": hint}]

    @vf.stop
    async def guessed(self, state) -> bool:
        if not state["trajectory"]:
            return False
        return (state["trajectory"][-1]["completion"][-1].content or "").strip() == state["answer"]


def exact(completion, answer, parser) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


def group_rank(completions, answers, parser) -> list[float]:
    """A group reward function: 1 for the group's shortest replies."""
    lengths = [len(parser.parse_answer(c) or "") for c in completions]
    return [1.0 if n == min(lengths) else 0.0 for n in lengths]


def load_guess(max_turns: int = 3) -> vf.Environment:
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[exact], weights=[1.0], parser=parser)
    return CountdownGuess(
        dataset=Dataset.from_list(_rows()), rubric=rubric, parser=parser, max_turns=max_turns
    )


def load_grouped() -> vf.Environment:
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[exact, group_rank], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(_rows()), rubric=rubric, parser=parser)


def load_from_hub() -> vf.Environment:
    """An environment whose dataset comes from the Hugging Face Hub."""
    from datasets import load_dataset

    dataset = load_dataset("rlpost-tests/no-such-dataset", split="train")
    return vf.SingleTurnEnv(dataset=dataset)


def arith_rubric() -> vf.Rubric:
    return vf.Rubric(funcs=[exact], weights=[2.0], parser=vf.Parser())


# ---------------------------------------------------------------- the Task generation

import verifiers.v1 as v1  # noqa: E402  (0.3.1 ships it; 0.4.0's only API)


class SumData(v1.TaskData):
    answer: str


class SumTask(v1.Task[SumData, v1.State, v1.TaskConfig]):
    """0.4.0-style rewards: weighted @vf.reward methods, a @vf.metric."""

    @v1.reward
    async def correct(self, task: SumData, trace: v1.Trace) -> float:
        return 1.0 if trace.last_reply == task.answer else 0.0

    @v1.reward(weight=0.25)
    async def short(self, trace: v1.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 2 else 0.0

    @v1.metric
    async def reply_chars(self, trace: v1.Trace) -> float:
        return float(len(trace.last_reply))


def load_string_task() -> vf.Environment:
    """A row routed by a plain-string task column, which verifiers 0.3.1 no longer takes."""
    rows = [{**r, "task": "arith"} for r in _rows(2)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=arith_rubric())
