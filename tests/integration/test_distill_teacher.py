"""Distillation teachers: a local checkpoint and a real ``rlpost serve`` on loopback score
the same tokens alike; a teacher with another tokenizer is refused in one line."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from rlpost.models.loading import load_causal_lm, load_tokenizer
from rlpost.models.tiny import save_tiny_checkpoint
from rlpost.models.vocab import vocab_digest
from rlpost.train.batch import collate, compute_logprobs
from rlpost.train.teacher import LocalTeacher, ServerTeacher, TeacherError, build_teacher
from rlpost.types import Completion
from tests.integration.test_server import start_server, stop_server

SHAPE = {"hidden_size": 32, "intermediate_size": 64}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    # another seed than the student: the teacher's logprobs differ from the student's
    return save_tiny_checkpoint(tmp_path_factory.mktemp("teacher") / "model", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def served(teacher_dir):
    proc, url = start_server(teacher_dir)
    yield url
    stop_server(proc)


def _batch(tokenizer):
    rows = [("1+2=", "3"), ("10-4=", "6"), ("7+7=", "14")]
    completions = []
    for i, (prompt, answer) in enumerate(rows):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completions.append(Completion(p, ids, [0.0] * len(ids), "stop", 0, i))
    return collate(completions, [0.0] * len(rows), tokenizer.pad_token_id)


def test_local_teacher_scores_the_responses_as_the_trainer_would(teacher_dir):
    tok = load_tokenizer(teacher_dir)
    batch = _batch(tok)
    teacher = build_teacher(str(teacher_dir), None, tok, micro_batch_size=2)
    got = teacher.logprobs(batch)
    want = compute_logprobs(load_causal_lm(teacher_dir), batch, temperature=1.0, micro_batch_size=8)
    real = batch.attention_mask[:, batch.prompt_width :] > 0
    assert torch.allclose(got[real], want[real], atol=1e-5)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))
    logits = teacher.logits(batch)
    assert logits.shape == (*batch.responses.shape, len(tok))
    picked = torch.log_softmax(logits, -1).gather(-1, batch.responses[..., None])[..., 0]
    assert torch.allclose(picked[real], got[real], atol=1e-5)


def test_server_teacher_matches_the_local_teacher(teacher_dir, served):
    tok = load_tokenizer(teacher_dir)
    batch = _batch(tok)
    local = LocalTeacher(str(teacher_dir), vocab_digest(tok)).logprobs(batch)
    remote = ServerTeacher(served, vocab_digest(tok))
    got = remote.logprobs(batch)
    remote.close()
    assert torch.allclose(got, local, atol=1e-4)
    assert got.abs().sum() > 0


def test_scoring_route_refuses_bad_requests_in_one_line(served):
    for body, needle in [
        ({"prompts": [], "starts": []}, "prompts must be a non-empty list"),
        ({"prompts": [[5, 6]], "starts": [0]}, "starts[0]=0 must be an integer in [1, 2]"),
        ({"prompts": [[5, 100000]], "starts": [1]}, "token id outside"),
        ({"prompts": [[5, 6]], "starts": [1, 1]}, "one position per prompt"),
    ]:
        r = httpx.post(f"{served}/v1/prompt_logprobs", json=body, timeout=30)
        assert r.status_code == 400, body
        message = r.json()["error"]["message"]
        assert needle in message and "\n" not in message
    info = httpx.get(f"{served}/v1/tokenizer", timeout=30).json()
    assert info["vocab_size"] == 100 and len(info["vocab_sha256"]) == 64


def _other_tokenizer(teacher_dir):
    tok = load_tokenizer(teacher_dir)
    tok.add_tokens(["<extra>"])
    return tok


def test_another_tokenizer_is_refused_in_one_line(teacher_dir, served):
    other = _other_tokenizer(teacher_dir)
    with pytest.raises(TeacherError) as local:
        build_teacher(str(teacher_dir), None, other)
    with pytest.raises(TeacherError) as remote:
        build_teacher(None, served, other)
    for exc, key in ((local, "model.teacher.path="), (remote, "model.teacher.url=")):
        line = str(exc.value)
        assert line.startswith(key) and line.count(key) == 1 and "\n" not in line
        assert "101" in line and "100 tokens" in line and "student's tokenizer" in line


def test_a_server_that_is_not_there_is_a_one_line_error():
    with pytest.raises(
        TeacherError, match=re.escape("model.teacher.url=http://127.0.0.1:9: Connect")
    ):
        ServerTeacher("http://127.0.0.1:9", {"vocab_size": 1}, timeout=2)


def test_a_run_distils_from_the_served_teacher(tmp_path, teacher_dir, served):
    import json

    from rlpost.config import load_config
    from rlpost.pipeline.loop import train
    from tests.conftest import small_overrides

    over = small_overrides(
        tmp_path, **{"model.teacher.url": served, "sft.steps": 0, "train.steps": 2, "eval.every": 0}
    )
    result = train(load_config("rlpost/recipes/distill_arith.yaml", over))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill_kl" in r]
    assert len(steps) == 2
    # two different random models: the student's tokens are unlikely under the teacher
    assert all(r["teacher_seconds"] > 0 and r["distill_kl"] != 0 for r in steps)


@pytest.mark.parametrize("where", ["path", "url"])
def test_a_refused_teacher_leaves_no_run_directory(tmp_path, teacher_dir, served, where):
    """The teacher is checked before the run directory is touched, so the corrected command
    is not refused as "already exists"."""
    import shutil

    from rlpost.config import load_config
    from rlpost.pipeline.loop import train
    from tests.conftest import small_overrides

    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    _other_tokenizer(teacher_dir).save_pretrained(other)
    # the student has the other tokenizer when the teacher is a server: the pair differs
    student = {"model.path": str(other)} if where == "url" else {}
    teacher = {"path": str(other)} if where == "path" else {"url": served}
    runs = tmp_path / "runs"
    over = small_overrides(
        runs, **student, **{f"model.teacher.{k}": v for k, v in teacher.items()}, **{"sft.steps": 0}
    )
    with pytest.raises(TeacherError, match="student's tokenizer"):
        train(load_config("rlpost/recipes/distill_arith.yaml", over))
    assert not (runs / "t").exists()
