"""``algo.old_logprobs``: where the policy loss's ratio is anchored. ``rollout`` takes the
engine's sampling logprobs and skips the trainer's own pass; in sync mode, with the engine
serving the trainer's fp32 weights, they are the trainer's logprobs up to float rounding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlpost.config import ConfigError, load_config
from rlpost.pipeline import build
from rlpost.pipeline.rules import check
from rlpost.pipeline.stages import TrainSettings, collate_groups, train_stage
from rlpost.resolved import resolve_step_plan
from rlpost.types import Group, Prompt
from tests.conftest import small_overrides


class Recording:
    """A trainer worker that records which logprob passes it was asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def logprobs(self, batch, which="old"):
        self.asked.append(which)
        return self.inner.logprobs(batch, which)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _scored(cfg, rollout, policy):
    prompts = [Prompt(f"{i}+{i}=", answer=str(2 * i)) for i in range(4)]
    params = build.sampling_params(cfg, eos_token_id=0)
    rollout.load_weights(policy.named_parameters(), 0)
    groups = rollout.generate(prompts, params, cfg.rollout.n, train=True).groups
    return [Group(g.prompt, g.completions, [float(i % 2) for i in range(g.n)]) for g in groups]


def test_rollout_logprobs_anchor_the_ratio_without_a_trainer_pass(tmp_path):
    over = {"rollout.n": 4, "rollout.max_tokens": 4, "train.mini_batch_size": 8}
    cfg = load_config(None, small_overrides(tmp_path, **over, **{"algo.old_logprobs": "rollout"}))
    model, tokenizer = build.build_policy(cfg)
    trainer = build.build_trainer_worker(cfg, model, tokenizer)
    rollout = build.build_rollout_worker(cfg)
    groups = _scored(cfg, rollout, model)
    plan = resolve_step_plan(cfg)
    assert plan.old_source(16, step=0) == "rollout"
    # two mini-batches: with the trainer's old logprobs this step would run a pass
    assert replace(plan, old_logprobs="trainer").old_source(16, step=0) == "pass"
    recomputed = trainer.logprobs(collate_groups(groups, 0), "old")
    recording = Recording(trainer)
    stats = train_stage(groups, recording, TrainSettings(cfg.algo, plan), pad_id=0)
    assert "old" not in recording.asked
    assert stats.metrics["logprob_gap"] == 0.0  # the anchor is the engine's own
    batch = collate_groups(groups, 0)
    mask = batch.response_mask.bool()
    engine = batch.rollout_logprobs[mask]
    assert torch.allclose(engine, recomputed[mask], atol=1e-4), (
        (engine - recomputed[mask]).abs().max()
    )


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"rollout.top_p": 0.9}, "rollout.top_p=0.9"),
        ({"algo.rollout_correction.name": "tis"}, "algo.rollout_correction.name=tis"),
        ({"algo.loss.tis_cap": 2.0}, "algo.loss.tis_cap=2.0"),
        ({"algo.loss": "flash_reinforce"}, "algo.loss.name=flash_reinforce"),
        ({"model.dtype": "bfloat16"}, "model.dtype=bfloat16"),
        ({"sync.codec": "fp8"}, "sync.codec=fp8"),
    ],
)
def test_rollout_logprobs_refuse_what_would_make_them_wrong_in_one_line(tmp_path, extra, named):
    with pytest.raises(ConfigError) as err:
        check(
            load_config(
                None, small_overrides(tmp_path, **{"algo.old_logprobs": "rollout", **extra})
            )
        )
    assert named in str(err.value) and "\n" not in str(err.value)
