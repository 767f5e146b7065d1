"""A tiny sequence-classification reward model, built in-code, scored end to end."""

import math
from pathlib import Path

import pytest

from rlpost.config import RewardConfig, RewardTerm
from rlpost.rewards.model import RewardModelWorker
from rlpost.rewards.scorer import build_scorer
from rlpost.types import RewardSample

SAMPLES = [
    RewardSample("what is 2 plus 2 ", "the answer is 4", answer="4"),
    RewardSample("q ", "i do not know", answer="4"),
    RewardSample("", "", answer="4"),  # empty text still gets a score
    RewardSample("unseen words ", "a good response is helpful honest and short " * 8, answer="4"),
]


TINY_CORPUS = [
    "the answer is 4 because 2 plus 2 is 4",
    "i do not know the answer",
    "question what is 3 times 5 answer 15",
    "a good response is helpful honest and short",
    "a bad response repeats repeats repeats itself",
]


def build_tiny_reward_model(out_dir: Path, seed: int = 0) -> Path:
    """Build and save a tiny random ``LlamaForSequenceClassification``.

    A word-level tokenizer is trained in-code on ``TINY_CORPUS`` (nothing is
    downloaded) and saved next to the model; both load back with the Auto classes.
    Returns ``out_dir``.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(
        TINY_CORPUS, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))


@pytest.fixture(scope="module")
def worker(model_dir):
    return RewardModelWorker(str(model_dir), batch_size=4)


def test_saved_model_loads_with_auto_classes(worker):
    # The worker loads through AutoTokenizer / AutoModelForSequenceClassification.
    assert type(worker.model).__name__ == "LlamaForSequenceClassification"
    assert worker.model.config.num_labels == 1 and worker.model.config.hidden_size == 32
    assert worker.tokenizer.pad_token == "[PAD]"
    assert worker.model.config.pad_token_id == worker.tokenizer.pad_token_id


def test_scores_are_finite_ordered_and_batch_invariant(worker):
    worker.batch_size = 4
    batched = worker.score(SAMPLES)
    worker.batch_size = 1
    one_by_one = worker.score(SAMPLES)
    assert len(batched) == 4 and all(math.isfinite(v) for v in batched)
    assert batched == pytest.approx(one_by_one, abs=1e-5)  # padding does not change a score
    assert len(set(batched)) == 4  # different texts, different scores
    worker.batch_size = 2
    assert worker.score(SAMPLES[::-1]) == pytest.approx(batched[::-1], abs=1e-5)
    assert worker.score([]) == []


def test_registered_term_mixes_and_nan_from_model_is_counted(model_dir):
    cfg = RewardConfig(
        terms=[
            RewardTerm(name="exact_match"),
            RewardTerm(name="reward_model", path=str(model_dir), batch_size=2),
        ]
    )
    scorer = build_scorer(cfg)
    assert scorer.alpha == 0.8 and scorer.terms[1].kind == "model"
    out = scorer.score(SAMPLES)
    rm = out.components["reward_model"]
    assert out.scores == pytest.approx([0.2 * v for v in rm])  # exact_match is 0 for all
    worker = scorer.terms[1].scorer
    worker.model.score.weight.data.fill_(math.nan)  # a diverged reward model
    out = scorer.score(SAMPLES)
    assert out.invalid == 4 and out.scores == [0.0] * 4
    assert scorer.counters()["reward_model/invalid"] == 4
    scorer.close()


def test_bad_path_and_batch_size():
    with pytest.raises(ValueError, match="not a local model directory"):
        RewardModelWorker("/no/such/dir")
    with pytest.raises(ValueError, match="batch_size"):
        RewardModelWorker("/no/such/dir", batch_size=0)
