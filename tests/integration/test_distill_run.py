"""A short on-policy distillation run: the student's KL to the teacher falls, and the
config errors a distillation run can meet are one line each."""

from __future__ import annotations

import json

import pytest

from rlpost import cli
from rlpost.config import load_config
from rlpost.pipeline import rules
from rlpost.pipeline.loop import train
from tests.conftest import small_overrides

RECIPE = "rlpost/recipes/distill_arith.yaml"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    # a short warm-up of the tiny model: peaked where the untrained student is near uniform
    out = tmp_path_factory.mktemp("teacher")
    args = small_overrides(out, **{"sft.steps": 40, "run.name": "teacher"})
    assert cli.main(["sft", "rlpost/recipes/grpo_arith.yaml", *args]) == 0
    return out / "teacher" / "sft_model"


def _distill_kl(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["distill_kl"] for r in rows if "distill_kl" in r]


def _overrides(tmp_path, teacher_dir, **extra):
    base = {
        "model.teacher.path": str(teacher_dir),
        "sft.steps": 0,
        "rollout.prompts_per_step": 8,
        "rollout.n": 2,
        "train.mini_batch_size": 16,
        "train.micro_batch_size": 16,
        "train.steps": 16,
        "train.optim.lr": 1e-2,
        "train.optim.warmup_steps": 0,
        "eval.every": 0,
        "checkpoint.every": 0,
        **extra,
    }
    return small_overrides(tmp_path, **base)


@pytest.mark.parametrize(
    "algo",
    [
        {},  # the recipe: on_policy_distill advantage with ppo_clip
        {"algo.advantage": "grpo", "algo.loss": "gkd"},
    ],
    ids=["advantage", "gkd_loss"],
)
def test_distillation_run_lowers_the_kl_to_the_teacher(tmp_path, teacher_dir, algo):
    cfg = load_config(RECIPE, _overrides(tmp_path, teacher_dir, **algo))
    result = train(cfg)
    kl = _distill_kl(result.run_dir)
    assert len(kl) == 16
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.7 * first, kl
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["teacher_seconds"] > 0 for r in rows if "teacher_seconds" in r)


def _problem(tmp_path, teacher_dir, **extra) -> str | None:
    cfg = load_config(RECIPE, _overrides(tmp_path, teacher_dir, **extra))
    found = rules.problems(cfg, "train")
    return found[0] if found else None


def test_distillation_config_errors_are_one_line(tmp_path, teacher_dir):
    cases = {
        "model.teacher.path=None: on_policy_distill distils": {"model.teacher.path": "null"},
        "needs the teacher's full logits": {
            "model.teacher.path": "null",
            "model.teacher.url": "http://127.0.0.1:8000",
            "algo.loss": "gkd",
        },
        "names a teacher too": {"model.teacher.url": "http://127.0.0.1:8000"},
        "model.teacher.path=/nonexistent/teacher: not a directory": {
            "model.teacher.path": "/nonexistent/teacher"
        },
        "no part of the run reads it": {"algo.advantage": "grpo"},
        "task_weight is 0 too": {"algo.advantage.distill_weight": 0.0},
    }
    for needle, extra in cases.items():
        line = _problem(tmp_path, teacher_dir, **extra)
        assert line is not None and needle in line and "\n" not in line, (needle, line)
    assert _problem(tmp_path, teacher_dir) is None
