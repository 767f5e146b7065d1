"""GRPO steps of the tiny model on a GPU (run.device=cuda): trainer and engine on cuda.

Skipped where torch sees no GPU. Self-contained and quick: a tiny model built from
its config, prompts generated in code, a few steps each.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlpost.algos import get_advantage_estimator, scores_to_token_rewards
from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.rollout.engines.continuous import ContinuousEngine
from rlpost.rollout.engines.prefix_cache import PrefixCache
from rlpost.rollout.engines.scheduler import Scheduler
from rlpost.train.batch import collate
from rlpost.train.dp import DPSpec, free_port
from tests.conftest import small_overrides

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["12+7=", "3-9=", "20+11=", "5+5="]
# fp32: engine (cached decode) and trainer (full forward) agree to rounding; bf16: both
# compute under bf16 autocast (the engine's matrices cast once), apart by the kernels' shapes.
ATOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _cfg(tmp_path, dtype: str, **extra):
    over = small_overrides(
        tmp_path,
        **{"run.device": "cuda", "model.dtype": dtype, "rollout.max_tokens": 8, **extra},
    )
    return load_config(None, over)


def _batch(engine, cfg, tok):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    params = build.sampling_params(cfg, tok.eos_token_id)
    cs = engine.generate(ids, params, n=4)
    # a reward that varies within groups (the tiny model samples near-uniform tokens)
    scores = [float(bool(c.token_ids) and c.token_ids[0] % 2 == 0) for c in cs]
    b = collate(cs, scores, tok.pad_token_id)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


def _check_logprobs(worker, batch, atol: float) -> None:
    """The trainer's recomputed logprobs (kept as the batch's old ones) match the engine's."""
    batch.old_logprobs = worker.logprobs(batch, "old")
    assert batch.old_logprobs.device.type == "cpu"
    mask = batch.response_mask > 0
    gap = float((batch.old_logprobs - batch.rollout_logprobs)[mask].abs().max())
    assert gap < atol, f"engine vs trainer logprobs differ by {gap:.3g} (atol {atol})"


def _grpo_steps(cfg, engine, worker, tok, steps: int = 3) -> None:
    start = [p.detach().cpu().clone() for _, p in worker.export_weights().tensors]
    for _ in range(steps):
        batch = _batch(engine, cfg, tok)
        _check_logprobs(worker, batch, ATOL[cfg.model.dtype])
        result = worker.update(batch, beta=0.0)
        assert math.isfinite(result.stats["loss"]), result.stats
        assert math.isfinite(result.stats["grad_norm"]), result.stats
        weights = worker.export_weights()
        assert all(t.device.type == "cpu" for _, t in weights.tensors)
        engine.load_weights(weights.tensors, version=weights.version)
    moved = max(
        float((a - b.float()).abs().max())
        for a, (_, b) in zip(start, worker.export_weights().tensors, strict=True)
    )
    assert moved > 0, "no weight changed after the updates"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_steps_on_cuda(tmp_path, dtype):
    cfg = _cfg(tmp_path, dtype)
    model, tok = build.build_policy(cfg)
    engine = build.build_engine(cfg, model, tok)
    worker = build.build_trainer_worker(cfg, model, tok)
    assert next(worker.trainer.model.parameters()).device.type == "cuda"
    assert next(engine.model.parameters()).device.type == "cuda"
    # fp32 master weights whatever the compute dtype
    assert next(worker.trainer.model.parameters()).dtype == torch.float32
    _grpo_steps(cfg, engine, worker, tok)
    # optimizer state follows the parameters
    state = next(iter(worker.trainer.optimizer.state.values()))
    assert state["exp_avg"].device.type == "cuda"
    # a checkpoint written on cuda restores onto cuda
    worker.save(tmp_path / "ckpt")
    before = [t.clone() for _, t in worker.export_weights().tensors]
    batch = _batch(engine, cfg, tok)
    batch.old_logprobs = worker.logprobs(batch, "old")
    worker.update(batch, beta=0.0)
    worker.restore(tmp_path / "ckpt", version=3)
    after = [t for _, t in worker.export_weights().tensors]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    state = next(iter(worker.trainer.optimizer.state.values()))
    assert state["exp_avg"].device.type == "cuda"


def test_continuous_engine_on_cuda(tmp_path):
    cfg = _cfg(tmp_path, "float32")
    model, tok = build.build_policy(cfg)
    worker = build.build_trainer_worker(cfg, model, tok)
    serving = copy.deepcopy(model).requires_grad_(False)  # a frozen copy, on cuda
    engine = ContinuousEngine(
        Scheduler(serving, tok, max_batch=16, prefix_cache=PrefixCache(), seed=0).start(), tok
    )
    try:
        _grpo_steps(cfg, engine, worker, tok, steps=2)
    finally:
        engine.close()


def test_ppo_critic_on_cuda(tmp_path):
    cfg = _cfg(tmp_path, "bfloat16", **{"algo.advantage": "gae"})
    model, tok = build.build_policy(cfg)
    engine = build.build_engine(cfg, model, tok)
    worker = build.build_trainer_worker(cfg, model, tok)
    batch = _batch(engine, cfg, tok)
    values = worker.values(batch)
    assert values is not None and values.device.type == "cpu"
    batch.values, batch.returns = values, values + batch.scores[:, None]
    stats = worker.update_critic(batch)
    assert math.isfinite(stats["vf_loss"]), stats


def test_sharded_trainer_over_nccl(tmp_path):
    cfg = _cfg(tmp_path, "bfloat16", **{"cluster.backend": "process"})
    model, tok = build.build_policy(cfg)
    engine = build.build_engine(cfg, model, tok)
    spec = DPSpec(rank=0, world=1, master_port=free_port(), backend="nccl")
    worker = build.build_trainer_worker(cfg, model, tok, dp=spec)
    try:
        _grpo_steps(cfg, engine, worker, tok, steps=2)
    finally:
        worker.close()
