"""The step plan: resolved once per algorithm from the config and the registries' traits,
and a train stage that hands the trainer records it never writes into (CPU, tiny model)."""

from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import torch

from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.pipeline.evaluate import logprob_gap
from rlpost.pipeline.stages import TrainSettings, collate_groups, train_stage
from rlpost.resolved import StepPlan, resolve_step_plan
from rlpost.types import Group, Prompt
from tests.conftest import small_overrides

ROWS = 16  # 4 prompts x n=4 in small_overrides


def _plan(tmp_path, recipe=None, **over) -> StepPlan:
    from rlpost.config import RECIPES_DIR

    path = None if recipe is None else RECIPES_DIR / recipe
    return resolve_step_plan(load_config(path, small_overrides(tmp_path, **over)))


def test_grpo_with_kl_keeps_a_reference_and_passes_when_two_steps(tmp_path):
    plan = _plan(tmp_path)  # mini-batch 8 of 16 rows: two optimizer steps
    assert plan.reference and not plan.values and not plan.kl_in_reward
    assert plan.old_source(ROWS, step=0) == "pass"
    assert plan.old_source(8, step=0) == "update"  # a batch one step covers
    assert plan.trains_policy(0)


def test_grpo_without_kl_single_update_takes_the_loss_pass(tmp_path):
    plan = _plan(tmp_path, **{"algo.kl.beta": 0.0, "train.mini_batch_size": ROWS})
    assert not plan.reference
    assert plan.old_source(ROWS, step=0) == "update"


def test_more_epochs_never_take_the_shortcut(tmp_path):
    plan = _plan(tmp_path, **{"train.mini_batch_size": ROWS, "train.epochs": 2})
    assert plan.single_update_rows == 0 and plan.old_source(1, step=0) == "pass"


def test_ppo_with_a_critic_passes_and_warms_up(tmp_path):
    over = {"train.mini_batch_size": ROWS, "critic.head_start_steps": 2}
    plan = _plan(tmp_path, "ppo_arith.yaml", **over)
    assert plan.values and plan.reference and plan.kl_in_reward
    assert [plan.trains_policy(s) for s in range(3)] == [False, False, True]
    # the KL in the reward reads the old logprobs before any update: a pass even when single
    assert plan.old_source(ROWS, step=2) == "pass"


def test_what_reads_old_logprobs_first_forces_a_pass(tmp_path):
    single = {"train.mini_batch_size": ROWS, "algo.kl.beta": 0.0}
    selector = _plan(tmp_path, "kl_cov_arith.yaml", **single)
    assert selector.token_selector and selector.old_source(ROWS, step=0) == "pass"
    otb = _plan(tmp_path, **single, **{"algo.advantage": "optimal_token_baseline"})
    assert otb.sum_pi_squared and otb.old_source(ROWS, step=0) == "pass"
    engine = _plan(tmp_path, **single, **{"algo.old_logprobs": "rollout"})
    assert engine.old_source(ROWS, step=0) == "rollout"
    assert _plan(tmp_path, **{"algo.advantage": "gdpo"}).components
    assert _plan(tmp_path, **{"algo.advantage": "remax"}).greedy_baseline


class Checking:
    """A trainer worker that snapshots every batch it is handed and, after each call,
    asserts the call left it as it came (every field and every tensor)."""

    def __init__(self, inner):
        self.inner, self.calls, self.old_from_update = inner, [], None

    def _checked(self, name, batch, *args, **kwargs):
        before = copy.deepcopy(batch)
        out = getattr(self.inner, name)(batch, *args, **kwargs)
        for f in fields(batch):
            a, b = getattr(before, f.name), getattr(batch, f.name)
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same and (a is None) == (b is None), (name, f.name)
        self.calls.append(name)
        return out

    def logprobs(self, batch, which="old"):
        return self._checked("logprobs", batch, which)

    def values(self, batch):
        return self._checked("values", batch)

    def update_critic(self, batch):
        return self._checked("update_critic", batch)

    def update(self, batch, **kwargs):
        result = self._checked("update", batch, **kwargs)
        self.old_from_update = result.old_logprobs
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _groups(cfg, model):
    prompts = [Prompt(f"{i}+{i}=", answer=str(2 * i)) for i in range(4)]
    rollout = build.build_rollout_worker(cfg)
    rollout.load_weights(model.named_parameters(), 0)
    params = build.sampling_params(cfg, eos_token_id=0)
    groups = rollout.generate(prompts, params, cfg.rollout.n, train=True).groups
    return [Group(g.prompt, g.completions, [float(i % 2) for i in range(g.n)]) for g in groups]


@pytest.mark.parametrize(
    ("recipe", "over", "source"),
    [
        (None, {}, "pass"),
        (None, {"train.mini_batch_size": ROWS}, "update"),
        ("ppo_arith.yaml", {"train.mini_batch_size": ROWS, "critic.head_start_steps": 0}, "pass"),
    ],
)
def test_the_trainer_never_writes_into_its_batch(tmp_path, recipe, over, source):
    from rlpost.config import RECIPES_DIR

    path = None if recipe is None else RECIPES_DIR / recipe
    cfg = load_config(path, small_overrides(tmp_path, **over))
    model, tokenizer = build.build_policy(cfg)
    worker = build.build_trainer_worker(cfg, model, tokenizer)
    plan = resolve_step_plan(cfg)
    described = worker.describe()  # the builder kept what the plan reads
    assert (described["has_reference"], described["has_critic"]) == (plan.reference, plan.values)
    groups = _groups(cfg, model)
    assert plan.old_source(ROWS, step=0) == source
    expected_old = worker.logprobs(collate_groups(groups, 0), "old")  # before the update
    trainer = Checking(worker)
    stats = train_stage(groups, trainer, TrainSettings(cfg.algo, plan), pad_id=0)
    assert "update" in trainer.calls
    assert (trainer.old_from_update is not None) == (source == "update")
    batch = collate_groups(groups, 0)
    mask = batch.response_mask.bool()
    if source == "update":  # the shortcut is returned, not written back
        torch.testing.assert_close(
            trainer.old_from_update[mask], expected_old[mask], atol=1e-5, rtol=0
        )
    # the metrics read the old logprobs wherever they came from
    gap = logprob_gap(batch.rollout_logprobs, expected_old, batch.response_mask)
    assert stats.metrics["logprob_gap"] == pytest.approx(gap, abs=1e-5)
    assert abs(stats.metrics["kl"]) < 1e-5  # the reference is the starting policy
