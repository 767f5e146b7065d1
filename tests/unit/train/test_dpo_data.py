"""DPO inputs on CPU: the built-in pairs, user files, pair tensors, config checks, accumulation."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from rlpost.config import ConfigError, DPOConfig, load_config
from rlpost.data.files import DataError
from rlpost.data.preferences import (
    PreferencePair,
    load_preference_file,
    preference_splits,
    split_off,
)
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.pipeline.rules import check
from rlpost.train.batch import response_logits, token_logprobs
from rlpost.train.dpo import (
    DPO,
    attach_reference,
    encode_pairs,
    evaluate_pairs,
    pair_batch,
    pair_logprobs,
    sequence_logprobs,
)
from rlpost.train.optim import optimizer_step


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors gain nothing from more threads, and a busy shared CPU stalls them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, hidden_size=32, intermediate_size=64, seed=5), tokenizer


def _pairs(n: int = 6) -> list[PreferencePair]:
    return [PreferencePair(f"{i}+{i}=", str(2 * i), str(2 * i + 1 + i % 3)) for i in range(n)]


# ------------------------------------------------------------------ built-in task


def test_builtin_split_is_fixed_disjoint_and_correct():
    train, held = preference_splits(
        30, ["+", "-"], train_size=10**6, eval_size=300, rejected_per_prompt=2, max_offset=20
    )
    again, held_again = preference_splits(
        30, ["+", "-"], train_size=10**6, eval_size=300, rejected_per_prompt=2, max_offset=20
    )
    assert train == again and held == held_again
    assert len(held) == 300 and len(train) == 2 * (2 * 31 * 31 - 300)
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    for p in train + held:
        a, op, b = p.prompt[:-1].partition("+") if "+" in p.prompt else p.prompt[:-1].partition("-")
        assert int(p.chosen) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert 1 <= abs(int(p.rejected) - int(p.chosen)) <= 20
    by_prompt: dict[str, list[str]] = {}
    for p in train:
        by_prompt.setdefault(p.prompt, []).append(p.rejected)
    assert all(len(set(r)) == 2 for r in by_prompt.values())  # distinct wrong answers


def test_builtin_split_refuses_impossible_settings():
    with pytest.raises(ValueError, match=r"rejected_per_prompt=5 must be in 1\.\.4"):
        preference_splits(5, ["+"], train_size=10, eval_size=5, rejected_per_prompt=5, max_offset=2)
    with pytest.raises(ValueError, match="eval_size=36 leaves no training prompts"):
        preference_splits(5, ["+"], train_size=10, eval_size=36)
    with pytest.raises(ValueError, match="repeats an operator"):
        preference_splits(5, ["+", "+"], train_size=10, eval_size=5)


# --------------------------------------------------------------------- user files


def _write_jsonl(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_file_rows_with_custom_fields_and_template(tmp_path):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [{"q": "2+2=", "good": "4", "bad": "5"}, {"q": "1+2=", "good": "3", "bad": "4", "x": 1}],
    )
    pairs, report = load_preference_file(
        path, prompt_field="q", chosen_field="good", rejected_field="bad", template="Q: {prompt}"
    )
    assert [p.prompt for p in pairs] == ["Q: 2+2=", "Q: 1+2="]
    assert [(p.chosen, p.rejected) for p in pairs] == [("4", "5"), ("3", "4")]
    assert report.rows == 2 and report.skipped == 0


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ('{"prompt": "a", "chosen": "b"}', "field 'rejected' is missing"),
        (
            '{"prompt": "a", "chosen": "b", "rejected": "b"}',
            "fields 'chosen' and 'rejected' are identical",
        ),
        ('{"prompt": "", "chosen": "b", "rejected": "c"}', "field 'prompt' is missing"),
        ("[1, 2]", "row is not an object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_rows_are_refused_with_file_and_line_or_skipped(tmp_path, bad, reason):
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    path = _write_jsonl(tmp_path / "p.jsonl", [good, bad, good])
    with pytest.raises(DataError) as err:
        load_preference_file(path)
    message = str(err.value)
    assert f"p.jsonl:2: {reason}" in message and "data.on_bad_row=skip" in message
    assert "\n" not in message
    pairs, report = load_preference_file(path, on_bad_row="skip")
    assert len(pairs) == 2 and report.skipped == 1 and "p.jsonl:2" in report.first_problem


def test_parquet_pairs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": ["3", "5"]})
    pq.write_table(table, tmp_path / "p.parquet")
    pairs, _ = load_preference_file(tmp_path / "p.parquet")
    assert [p.chosen for p in pairs] == ["2", "4"]


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_preference_file(tmp_path / "none.jsonl")
    path = _write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "a"}'])
    with pytest.raises(DataError, match="no usable rows"):
        load_preference_file(path, on_bad_row="skip")


def test_split_off_is_seeded_disjoint_and_complete():
    pairs = _pairs(20)
    train, held = split_off(pairs, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert sorted(p.prompt for p in train + held) == sorted(p.prompt for p in pairs)
    assert split_off(pairs, 0.25, seed=3) == (train, held)
    assert split_off(pairs, 0.25, seed=4) != (train, held)
    with pytest.raises(DataError, match="at least two rows"):
        split_off(pairs[:1], 0.5, seed=0)


# -------------------------------------------------------------------- pair tensors


def test_pair_batch_puts_chosen_first_and_ends_with_eos(tiny):
    _, tokenizer = tiny
    pairs = encode_pairs(_pairs(3), tokenizer)
    batch = pair_batch(pairs, [2, 0], tokenizer.pad_token_id)
    assert len(batch) == 4
    texts = []
    for row in range(4):
        n = int(batch.response_mask[row].sum())
        ids = batch.responses[row, :n].tolist()
        assert ids[-1] == tokenizer.eos_token_id
        texts.append(tokenizer.decode(ids[:-1]))
    assert texts == ["4", "0", "7", "1"]  # chosen of pairs 2, 0 then their rejected


def test_sequence_logprobs_sum_the_response_tokens(tiny):
    model, tokenizer = tiny
    pairs = encode_pairs(_pairs(4), tokenizer)
    batch = pair_batch(pairs, [0, 1, 2, 3], tokenizer.pad_token_id)
    with torch.no_grad():
        seq = sequence_logprobs(model, batch)
        lp = token_logprobs(response_logits(model, batch), batch.responses)
    for row in range(len(batch)):
        n = int(batch.response_mask[row].sum())
        assert float(seq[row]) == pytest.approx(float(lp[row, :n].sum()), abs=1e-5)
    chunked = pair_logprobs(model, pairs, tokenizer.pad_token_id, chunk=3)
    whole = pair_logprobs(model, pairs, tokenizer.pad_token_id, chunk=4)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[0], seq[:4], atol=1e-5, rtol=0)


def test_policy_equal_to_reference_is_a_coin_flip(tiny):
    model, tokenizer = tiny
    pairs = encode_pairs(_pairs(6), tokenizer)
    attach_reference(model, pairs, tokenizer.pad_token_id, chunk=4)
    m = evaluate_pairs(model, pairs, tokenizer.pad_token_id, DPOConfig().loss_kwargs(), chunk=4)
    assert m["eval_pref_accuracy"] == 0.5 and m["eval_margin"] == 0.0
    assert m["eval_loss"] == pytest.approx(0.6931, abs=1e-4)


def test_update_does_not_depend_on_the_micro_batch_size(tiny):
    model, tokenizer = tiny
    pairs = encode_pairs(_pairs(6), tokenizer)
    attach_reference(model, pairs, tokenizer.pad_token_id, chunk=6)
    # Move the reference away from the policy so the loss has a gradient at the start.
    pairs.ref_chosen = pairs.ref_chosen + torch.linspace(-1, 1, 6)
    grads = []
    for micro in (6, 4, 1):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        dpo = DPO(pairs, tokenizer.pad_token_id, micro, DPOConfig().loss_kwargs())
        parts = dpo.draw(random.Random(0), 6)
        out = optimizer_step(
            opt, sched, list(m.parameters()), 1e9, parts, lambda b, m=m, d=dpo: d.loss(m, b)
        )
        stats = {"loss": out.loss, **out.stats}
        grads.append((stats, torch.cat([p.grad.flatten() for p in m.parameters()])))
    (s6, g6), *rest = grads
    for stats, g in rest:
        assert stats["loss"] == pytest.approx(s6["loss"], rel=1e-5)
        assert stats["reward_margin"] == pytest.approx(s6["reward_margin"], rel=1e-5, abs=1e-7)
        torch.testing.assert_close(g, g6, rtol=1e-4, atol=1e-6)


# -------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("dpo.betta=0.1", "unknown config key 'dpo.betta'"),
        ("dpo.loss_type=hinge", "config dpo.loss_type='hinge'"),
        ("dpo.beta=0", "config dpo.beta=0"),
        ("dpo.micro_batch_size=128", "micro_batch_size=128 is larger than batch_size=64"),
        ("dpo.label_smoothing=0.1", None),
        ("data.task=file", "data.task.train_path=None: data.task=file reads its rows"),
        ("data.task.eval_size=5000", "eval_size=5000 leaves no training prompts"),
        ("data.task.ops=[+,+]", "repeats an operator"),
    ],
)
def test_config_problems_are_one_line(override, fragment):
    if fragment is None:  # a valid setting: conservative DPO with the sigmoid loss
        assert load_config(None, [override]).dpo.label_smoothing == 0.1
        return
    with pytest.raises(ConfigError) as err:
        check(load_config(None, ["data.task=prefs", override]), "dpo")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_ipo_with_label_smoothing_is_refused():
    with pytest.raises(ConfigError, match="no effect with loss_type=ipo"):
        load_config(None, ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"])
