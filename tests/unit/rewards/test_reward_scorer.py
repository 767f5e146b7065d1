"""RewardScorer: mixture math, invalid filtering, batched terms, name resolution."""

import math
import sys
import textwrap
import threading

import pytest

from rlpost.config import RewardConfig, RewardTerm
from rlpost.registry import UnknownNameError, UserCodeError
from rlpost.rewards.catalog import get_reward, lookup
from rlpost.rewards.scorer import DEFAULT_ALPHA, RewardScorer, Term, build_scorer
from rlpost.types import RewardSample


def samples(n: int) -> list[RewardSample]:
    return [RewardSample(f"p{i}", f"c{i}", answer=i) for i in range(n)]


class FixedScorer:
    """A batched scorer returning preset values, like a reward model would."""

    def __init__(self, values):
        self.values = values
        self.calls = 0

    def score(self, batch):
        self.calls += 1
        return list(self.values[: len(batch)])

    def counters(self):
        return {"retries": 3}


def const(value):
    return lambda sample, **_: value


def test_weighted_sum_skips_not_applicable():
    scorer = RewardScorer(
        [
            Term("a", const(1.0), 1.0, "verifiable"),
            Term("b", lambda s: None if s.answer == 0 else 0.5, 2.0, "rule"),
        ]
    )
    out = scorer.score(samples(2))
    assert out.scores == [1.0, 2.0]  # 1*1 ; 1*1 + 2*0.5
    assert math.isnan(out.components["b"][0]) and out.components["b"][1] == 0.5
    assert out.invalid == 0


def test_alpha_mixture_math():
    terms = [
        Term("acc", const(1.0), 1.0, "verifiable"),
        Term("fmt", const(0.5), 0.2, "rule"),
        Term("rm", None, 1.0, "model", scorer=FixedScorer([0.25, -1.0])),
    ]
    out = RewardScorer(terms, alpha=0.8).score(samples(2))
    # verifiable part 1 + 0.2*0.5 = 1.1; final = 0.8 * 1.1 + 0.2 * model
    assert out.scores == pytest.approx([0.8 * 1.1 + 0.2 * 0.25, 0.8 * 1.1 - 0.2])


def test_invalid_scores_replaced_and_counted():
    values = [math.nan, math.inf, 11.0, 0.5, None]
    terms = [
        Term("ok", const(1.0), 1.0, "verifiable"),
        Term("rm", None, 1.0, "model", scorer=FixedScorer(values)),
    ]
    scorer = RewardScorer(terms, invalid_score=-2.0, score_range=(-10.0, 10.0))
    out = scorer.score(samples(5))
    assert out.scores == [-2.0, -2.0, -2.0, 1.5, 1.0]
    assert out.invalid == 3
    assert all(math.isnan(v) for v in out.components["rm"][:3])
    assert scorer.counters() == {"ok/invalid": 0, "rm/invalid": 3, "rm/retries": 3}
    scorer.score(samples(1))
    assert scorer.counters()["rm/invalid"] == 4  # cumulative across batches


def test_batched_scorer_called_once_per_batch_and_length_checked():
    fake = FixedScorer([0.1] * 8)
    RewardScorer([Term("rm", None, 1.0, "model", scorer=fake)]).score(samples(8))
    assert fake.calls == 1
    short = RewardScorer([Term("rm", None, 1.0, "model", scorer=FixedScorer([0.1]))])
    with pytest.raises(ValueError, match="returned 1 scores for 3 samples"):
        short.score(samples(3))


def test_concurrent_per_sample_function_keeps_order():
    barrier = threading.Barrier(4, timeout=5)

    def slow(sample):
        barrier.wait()  # deadlocks (BrokenBarrierError) unless 4 calls run at once
        return float(sample.answer)

    slow.concurrency = 4
    out = RewardScorer([Term("io", slow, 1.0, "verifiable")]).score(samples(4))
    assert out.scores == [0.0, 1.0, 2.0, 3.0]


def test_reward_error_names_the_term_and_bad_return_type():
    def broken(sample):
        raise RuntimeError("boom")

    with pytest.raises(UserCodeError) as info:
        RewardScorer([Term("mine", broken, 1.0, "rule")]).score(samples(1))
    line = str(info.value)
    assert (
        line.startswith("reward 'mine': ")
        and "broken (" in line
        and "test_reward_scorer.py:" in line
    )
    assert "raised RuntimeError: boom on the sample" in line
    with pytest.raises(UserCodeError, match="returned 'high', not a float or None"):
        RewardScorer([Term("s", const("high"), 1.0, "rule")]).score(samples(1))


def test_a_batch_no_term_applies_to_is_an_error():
    scorer = RewardScorer(
        [Term("a", const(None), 1.0, "rule"), Term("b", const(None), 1.0, "rule")]
    )
    with pytest.raises(UserCodeError, match=r"every term returned None .* for all 3 samples"):
        scorer.score(samples(3))
    mixed = RewardScorer([Term("a", const(None), 1.0, "rule"), Term("b", const(1.0), 1.0, "rule")])
    assert mixed.score(samples(3)).scores == [1.0, 1.0, 1.0]  # one term applies: fine


def test_term_and_scorer_validation():
    with pytest.raises(ValueError, match="exactly one"):
        Term("x", None, 1.0, "model")
    with pytest.raises(ValueError, match="empty"):
        RewardScorer([])
    with pytest.raises(ValueError, match="alpha"):
        RewardScorer([Term("a", const(1.0), 1.0, "rule")], alpha=1.5)


def test_unknown_name_lists_valid_names():
    with pytest.raises(UnknownNameError) as info:
        lookup("numeric_mtach")
    message = str(info.value)
    for name in ("numeric_match", "math_verify", "countdown", "format", "judge", "reward_model"):
        assert name in message


def test_build_scorer_refuses_bad_params_and_batched_get_reward():
    cfg = RewardConfig(terms=[RewardTerm(name="numeric_match", positon="last")])
    with pytest.raises(ValueError, match="accepted: position"):
        build_scorer(cfg)
    with pytest.raises(ValueError, match="batched scorer"):
        get_reward("judge")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user reward module importable as ``user_rewards_mod``."""
    (tmp_path / "user_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def starts_with(sample, *, prefix="A"):
                return 1.0 if sample.completion.startswith(prefix) else 0.0

            class HalfModel:
                default_kind = "model"

                def __init__(self, value=0.5):
                    self.value = value

                def score(self, samples):
                    return [self.value] * len(samples)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_mod"
    sys.modules.pop("user_rewards_mod", None)


def test_package_module_function_loading(user_module):
    fn = get_reward(f"{user_module}:starts_with")
    assert fn(RewardSample("q", "Alpha")) == 1.0
    kind, factory = lookup(f"{user_module}:HalfModel")
    assert kind == "batch" and factory().score(samples(2)) == [0.5, 0.5]
    with pytest.raises(ValueError, match="NOT_CALLABLE is not callable"):
        get_reward(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module_xyz:fn")


def test_build_scorer_default_alpha_and_kind_inference(user_module):
    verifiable = RewardTerm(name="exact_match")
    model = RewardTerm(name=f"{user_module}:HalfModel", value=0.25)
    mixed = build_scorer(RewardConfig(terms=[verifiable, model]))
    assert mixed.alpha == DEFAULT_ALPHA
    assert [t.kind for t in mixed.terms] == ["verifiable", "model"]  # inferred
    out = mixed.score([RewardSample("q", "x", answer="x")])
    assert out.scores == pytest.approx([0.8 * 1.0 + 0.2 * 0.25])
    assert build_scorer(RewardConfig(terms=[verifiable])).alpha is None
    explicit = build_scorer(RewardConfig(terms=[verifiable, model], alpha=0.5))
    assert explicit.alpha == 0.5
    as_rule = RewardTerm(name=f"{user_module}:HalfModel", kind="rule")
    assert build_scorer(RewardConfig(terms=[as_rule])).terms[0].kind == "rule"


def test_duplicate_terms_get_distinct_labels(user_module):
    fn = f"{user_module}:starts_with"
    cfg = RewardConfig(terms=[RewardTerm(name=fn), RewardTerm(name=fn, prefix="B")])
    out = build_scorer(cfg).score([RewardSample("q", "Bee")])
    assert out.components == {fn: [0.0], f"{fn}#1": [1.0]}


def test_verifiable_accuracy_uses_verifiable_terms_only():
    scorer = RewardScorer(
        [
            Term(
                "acc", lambda s: None if s.answer == 2 else float(s.answer == 1), 1.0, "verifiable"
            ),
            Term("fmt", const(1.0), 1.0, "rule"),
        ]
    )
    out = scorer.score(samples(3))
    assert scorer.verifiable_accuracy(out) == 0.5  # answers 0 and 1; 2 is not applicable
    only_rule = RewardScorer([Term("fmt", const(1.0), 1.0, "rule")])
    assert only_rule.verifiable_accuracy(only_rule.score(samples(1))) is None


def test_a_combined_score_that_overflows_is_invalid_not_inf():
    big = [Term("a", const(10.0), 1e308, "verifiable"), Term("b", const(10.0), 1e308, "rule")]
    scorer = RewardScorer(big, score_range=(-100.0, 100.0))
    out = scorer.score(samples(2))
    assert out.scores == [0.0, 0.0] and out.invalid == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"score_range": (10.0, -10.0)},
        {"invalid_score": math.inf},
        {"terms": [{"name": "x", "weight": math.nan}]},
    ],
)
def test_reward_config_numbers_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        RewardConfig(**bad)


@pytest.mark.parametrize(
    ("name", "params", "says"),
    [
        ("numeric_match", {"position": "middle"}, "position must be 'first' or 'last'"),
        ("format", {"pattern": "("}, "invalid regex"),
        ("code_tests", {"sandbox": {"memroy_mb": 5}}, "memroy_mb"),
        ("code_tests", {"sandbox": {"memory_mb": 5}}, "memory_mb=5"),
    ],
)
def test_parameter_values_a_reward_would_refuse_are_refused_at_load(name, params, says):
    from rlpost.rewards.scorer import check_terms

    with pytest.raises(ValueError) as err:
        check_terms(RewardConfig(terms=[RewardTerm(name=name, **params)]))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_an_episodes_turn_reward_out_of_range_or_not_finite_makes_the_sample_invalid():
    from rlpost.types import Episode, Turn

    def episode(reward: float) -> Episode:
        return Episode([Turn("policy", 0, 2, reward=0.5), Turn("policy", 3, 4, reward=reward)])

    rewards = [0.25, 1e30, math.inf, math.nan, -10.5, 10.0]
    batch = [RewardSample("p", "c", episode=episode(r), finish_reason="length") for r in rewards]
    batch.append(RewardSample("p", "c"))  # no episode: only the terms decide
    scorer = RewardScorer([Term("one", const(1.0), 1.0, "rule")], invalid_score=-3.0,
                          score_range=(-10.0, 10.0), truncated_reward=0.0)  # fmt: skip
    scored = scorer.score(batch)
    # Truncated samples too: their turn rewards train beside truncated_reward.
    assert scored.invalid_rows == [1, 2, 3, 4] and scored.invalid == 4
    assert scored.scores == [0.0, -3.0, -3.0, -3.0, -3.0, 0.0, 1.0]
