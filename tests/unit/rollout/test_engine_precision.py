"""In bf16 the in-process engines sample from the distribution the trainer scores: the
engine computes as the trainer does under bf16 autocast (linear layers in bf16, the
residual stream, the norms and the LM head in float32, the trainer's attention kernel), so
its sampling logprobs are the trainer's, not 2e-3 nats a token away (a model wholly in bf16).
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.resolved import ENGINES, resolve
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.train.batch import collate, response_logits, token_logprobs
from rlpost.train.lm_head import serving_precision


@pytest.fixture(scope="module", params=["hf", "hf_continuous"])
def sampled(request, tmp_path_factory):
    """(engine, trainer, a batch the engine sampled) for the tiny model in bf16, its logits
    sharpened to a trained model's scale (tokens of 0.5 to 4 nats: the roundings show)."""
    cfg = load_config(
        None,
        [f"run.output_dir={tmp_path_factory.mktemp('bf16')}", "model.dtype=bfloat16"],
    )
    model, tok = build.build_policy(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)  # tied: the head's logits too
    trainer = build.build_trainer_worker(cfg, copy.deepcopy(model), tok)
    engine = ENGINES.get(request.param)(cfg, resolve(cfg), model, tok)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ["12+7=", "3-9=", "20+11="]]
    out = engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.0, seed=0), n=4)
    yield engine, trainer, collate(out, [0.0] * len(out), tok.pad_token_id)
    getattr(engine, "close", lambda: None)()


def test_bf16_sampling_logprobs_are_the_trainers(sampled):
    """Measured on this tiny model: 1.3e-7 a token (a model wholly in bf16: 1.9e-3)."""
    _, trainer, batch = sampled
    mask = batch.response_mask > 0
    gap = (batch.rollout_logprobs - trainer.logprobs(batch, "old"))[mask].abs()
    assert gap.mean() < 5e-4 and gap.max() < 5e-3, (gap.mean(), gap.max())
    assert trainer.logprobs(batch, "old")[mask].mean() < -0.5  # not all near-certain tokens


def test_the_engines_module_on_whole_rows_computes_the_trainers_logprobs(sampled):
    """The same rows through the engine's module without a cache run the trainer's kernels
    at the trainer's shapes: equal but for the float32 head's summation order, on any CPU
    (a model wholly in bf16: 1.3e-2 apart)."""
    engine, trainer, batch = sampled
    module = getattr(engine, "model", None) or engine.scheduler.model
    with torch.no_grad(), serving_precision(module):
        mine = token_logprobs(response_logits(module, batch), batch.responses)
    mask = batch.response_mask > 0
    gap = (mine - trainer.logprobs(batch, "old"))[mask].abs().max()
    assert gap < 1e-4, gap
