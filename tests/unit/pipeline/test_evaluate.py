"""Held-out evaluation: several samples per problem, their mean and its standard error."""

import math
from dataclasses import replace

import pytest
import torch

from rlpost.config import Config
from rlpost.pipeline.evaluate import evaluate, rollout_health
from rlpost.rewards.scorer import RewardWorker, build_scorer
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.worker import RolloutWorker
from rlpost.types import Completion, Prompt


class AnswerSheet:
    """Sample j of problem i answers correctly iff j < right[i] (greedy: iff right[i] > 0)."""

    def __init__(self, prompts, right):
        self.by_text = {p.text: (p.answer, r) for p, r in zip(prompts, right, strict=True)}
        self.calls = []
        self.seeds = []

    # The rest of the engine protocol (scripted answers cost no time).
    generator = torch.Generator()
    tokenizer = None
    closed = False

    def throughput(self):
        return 0.0

    def reset_stats(self):
        self.calls.clear()

    def close(self):
        self.closed = True

    def generate(self, prompt_ids, params, n=1, group_offset=0):
        self.calls.append((len(prompt_ids), n))
        self.seeds.append(params.seed)
        out = []
        for i, ids in enumerate(prompt_ids):
            answer, right = self.by_text["".join(chr(t) for t in ids)]
            for j in range(n):
                good = j < right if params.temperature > 0 else right > 0
                text = str(answer) if good else str(answer + 1)
                out.append(Completion(list(ids), [1], [0.0], "stop", 0, group_offset + i, text))
        return out


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def workers(engine):
    """The real rollout and reward workers around a scripted engine."""
    reward = RewardWorker(build_scorer(Config().reward, truncated_reward=0.0), max_tokens=16)
    return RolloutWorker(engine, CharTokenizer()), reward


def test_accuracy_is_the_mean_over_samples_with_its_standard_error():
    prompts = [Prompt(f"{i}+0=", answer=i) for i in range(5)]
    right = [0, 1, 2, 3, 4]  # of 4 samples each
    engine = AnswerSheet(prompts, right)
    rollout, reward = workers(engine)
    out = evaluate(rollout, reward, prompts, SamplingParams(), chunk=8, samples=4)
    per_problem = [r / 4 for r in right]
    mean = sum(per_problem) / 5
    se = math.sqrt(sum((a - mean) ** 2 for a in per_problem) / 4 / 5)
    assert out["eval_accuracy"] == pytest.approx(mean)
    assert out["eval_accuracy_stderr"] == pytest.approx(se)
    assert out["eval_problems"] == 5
    assert engine.calls == [(2, 4), (2, 4), (1, 4)]  # chunk counts samples, not prompts
    greedy = evaluate(rollout, reward, prompts, SamplingParams(temperature=0), samples=4)
    assert greedy["eval_accuracy"] == pytest.approx(4 / 5) and engine.calls[-1] == (5, 1)


@pytest.mark.parametrize("right", [[4, -1, 2, -1], [-1, -1, -1, -1]])
def test_a_problem_whose_samples_were_dropped_counts_as_wrong(right):
    """A failed harness or engine drops samples: the accuracy stays over every problem."""
    prompts = [Prompt(f"{i}+0=", answer=i) for i in range(len(right))]
    rollout, reward = workers(AnswerSheet(prompts, [max(r, 0) for r in right]))

    class Dropping:  # right < 0: the prompt's group comes back empty, as a failed harness's
        def generate(self, part, params, k):
            out = rollout.generate(part, params, k)
            keep = [right[prompts.index(g.prompt)] >= 0 for g in out.groups]
            out.groups = [
                g if ok else replace(g, completions=[])
                for g, ok in zip(out.groups, keep, strict=True)
            ]
            return out

    out = evaluate(Dropping(), reward, prompts, SamplingParams(), samples=4)
    kept = [r for r in right if r >= 0]
    assert out["eval_problems"] == len(right)
    assert out["eval_accuracy"] == pytest.approx(sum(kept) / 4 / len(right))
    assert out["eval_dropped"] == 4 * (len(right) - len(kept))
    assert math.isfinite(out["eval_reward_mean"]) and math.isfinite(out["eval_accuracy_stderr"])


def test_each_chunk_of_a_seeded_evaluation_gets_its_own_seed():
    prompts = [Prompt(f"{i}+0=", answer=i) for i in range(5)]
    engine = AnswerSheet(prompts, [1] * 5)
    rollout, reward = workers(engine)
    evaluate(rollout, reward, prompts, SamplingParams(seed=7), chunk=8, samples=4)
    assert engine.seeds == [7, 9, 11]  # seed + index of the chunk's first problem
    evaluate(rollout, reward, prompts, SamplingParams(), chunk=8, samples=4)
    assert engine.seeds[3:] == [None, None, None]


def test_a_truncated_answer_is_judged_by_its_text_in_evaluation():
    # rollout.truncated_reward shapes training only: held-out accuracy reads the answer.
    prompts = [Prompt("3+0=", answer=3)]

    class Truncating(AnswerSheet):
        def generate(self, prompt_ids, params, n=1, group_offset=0):
            out = super().generate(prompt_ids, params, n, group_offset)
            for c in out:
                c.finish_reason = "length"
            return out

    rollout, reward = workers(Truncating(prompts, [1]))
    out = evaluate(rollout, reward, prompts, SamplingParams(temperature=0))
    assert out["eval_accuracy"] == 1.0
    trained = reward.score(rollout.generate(prompts, SamplingParams(temperature=0), 1).groups)
    assert trained[0].scores == [0.0] and trained[0].components["truncated"] == [0.0]


def test_rollout_health_records_the_reward_range_a_plot_reads():
    completions = [Completion([1], [2], [0.0], "stop", 0, 0, "x") for _ in range(4)]
    m = rollout_health(completions, torch.tensor([0.0, 1.0, 1.0, 0.5]), torch.zeros(4))
    assert (m["reward_min"], m["reward_max"], m["reward_mean"]) == (0.0, 1.0, 0.625)


class Counts:
    """A progress reporter that keeps what it was told (the Phase protocol)."""

    def __init__(self):
        self.total, self.steps = 0, []

    def grow(self, n):
        self.total += n

    def advance(self, n, info=""):
        self.steps.append(n)


def test_evaluation_reports_progress_per_chunk_in_samples():
    prompts = [Prompt(f"{i}+0=", answer=i) for i in range(5)]
    rollout, reward = workers(AnswerSheet(prompts, [1] * 5))
    counts = Counts()
    evaluate(rollout, reward, prompts, SamplingParams(), chunk=8, samples=4, progress=counts)
    assert (counts.total, counts.steps) == (20, [8, 8, 4])
    evaluate(rollout, reward, prompts, SamplingParams(temperature=0), samples=4, progress=counts)
    assert (counts.total, counts.steps[3:]) == (25, [5])  # greedy: one sample a problem


def test_a_logprob_gap_on_the_same_weights_is_said_once_unless_corrected(caplog):
    """The engine sampling another distribution than the trainer scores (a dtype, kernels)
    is one line, once a run; not when a correction acts, nor for stale samples."""
    from types import SimpleNamespace

    from rlpost.config import load_config
    from rlpost.pipeline.loop import LOGPROB_GAP_NOTE, note_logprob_gap

    def run(*extra):
        return SimpleNamespace(cfg=load_config(None, list(extra)), gap_noted=False)

    big = {"logprob_gap": 0.037, "sample_lag_max": 0.0}
    r = run()
    with caplog.at_level("WARNING", logger="rlpost.pipeline.loop"):
        note_logprob_gap(r, {**big, "logprob_gap": LOGPROB_GAP_NOTE / 10}, 1)
        assert not caplog.records
        note_logprob_gap(r, big, 2)
        note_logprob_gap(r, big, 3)
        note_logprob_gap(run("algo.rollout_correction.name=tis"), big, 1)
        note_logprob_gap(run(), {**big, "sample_lag_max": 1.0}, 1)
    assert [rec.getMessage() for rec in caplog.records] == [
        "logprob_gap=0.037 at step 2: the engine samples from another policy than the trainer "
        "scores (nats a token, same weights); set algo.rollout_correction.name=tis to correct "
        "for it"
    ]
