"""The on-policy RL loop, top to bottom.

    prompts --rollout--> completions --rewards--> scores --algos--> advantages
            --train--> weights v+1 --sync--> engine serves v+1 --> held-out eval, checkpoint

Every step is synchronous (the engine always serves the newest weights), so
the trainer's old logprobs and the engine's differ only by numerics; the gap
is logged each step as a sync / precision check. Async and off-policy variants
belong in their own module, not behind flags here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlpost.algos import (
    AdaptiveKLController,
    FixedKLController,
    get_advantage_estimator,
    get_kl_estimator,
    kl_penalized_rewards,
    masked_mean,
    scores_to_token_rewards,
)
from rlpost.config import Config
from rlpost.data import PromptSampler
from rlpost.observe import Guards, Recorder
from rlpost.pipeline import build
from rlpost.pipeline.console import Console
from rlpost.pipeline.evaluate import evaluate, logprob_gap, rollout_health, to_reward_samples
from rlpost.pipeline.rundir import finish_run, prepare_run_dir, warm_start
from rlpost.rewards.scorer import build_scorer
from rlpost.sync import InProcessChannel
from rlpost.train.batch import TrainBatch, collate
from rlpost.types import ScoredBatch
from rlpost.train.checkpoint import latest_checkpoint, load_state, save_checkpoint, set_rng_state


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    history: list[dict] = field(default_factory=list)


class TrainingStopped(RuntimeError):
    """A guard stopped the run after its retries were spent."""


def train(cfg: Config, *, resume: Path | None = None, console: Console | None = None) -> RunResult:
    build.check_names(cfg)
    run_dir = prepare_run_dir(cfg, resume)
    console = console or Console(enabled=cfg.observe.progress)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    started = time.time()

    train_prompts, held_out, _ = build.build_data(cfg)
    held_out = held_out[: cfg.eval.limit] if cfg.eval.limit else held_out
    ckpt = latest_checkpoint(run_dir) if resume else None
    model, tokenizer = warm_start(cfg, run_dir, train_prompts, console, skip_sft=ckpt is not None)
    trainer = build.build_trainer(cfg, model)
    engine = build.build_engine(cfg, model, tokenizer)
    channel = InProcessChannel(engine)
    scorer = build_scorer(cfg.reward)
    sampler = PromptSampler(train_prompts, cfg.rollout.prompts_per_step, seed=cfg.run.seed)
    kl = cfg.algo.kl
    kl_ctl = AdaptiveKLController(kl.beta, kl.target, kl.horizon) if kl.target else FixedKLController(kl.beta)
    guards = Guards(cfg.observe.guards)
    params, eval_p = build.sampling_params(cfg, tokenizer), build.eval_params(cfg, tokenizer)

    start_step, history = 0, []
    if ckpt is not None:
        start_step = _restore(ckpt, model, trainer, engine, sampler, kl_ctl)
        channel.push(model, version=start_step)
    recorder = Recorder(
        run_dir, prometheus_port=cfg.observe.prometheus.port,
        prometheus_host=cfg.observe.prometheus.host, tensorboard=cfg.observe.tensorboard,
    )
    good_ckpt_step = start_step
    try:
        first_eval = evaluate(engine, tokenizer, held_out, scorer, eval_p)
        console.note_eval(start_step, first_eval)
        recorder.record(start_step, {**first_eval, "step_seconds": 0.0})
        console.start(cfg.train.steps, start_step)
        step = start_step
        while step < cfg.train.steps:
            m = rl_step(cfg, step, sampler, engine, tokenizer, scorer, trainer, kl_ctl, params, guards, recorder)
            step += 1
            m["sync_seconds"] = channel.push(model, version=step).seconds
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                m.update(evaluate(engine, tokenizer, held_out, scorer, eval_p))
            actions = guards.after_step(m)
            for action in actions:
                recorder.count_guard(action.guard)
                step, good = _carry_out(action, cfg, run_dir, step, model, trainer, engine, sampler, kl_ctl, channel)
                good_ckpt_step = good if good is not None else good_ckpt_step
            recorder.record(step, m)
            history.append({"step": step, **m})
            console.update(step, m)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                _save(cfg, run_dir, step, model, trainer, engine, sampler, kl_ctl)
                good_ckpt_step = step
        final_eval = evaluate(engine, tokenizer, held_out, scorer, eval_p)
        recorder.record(step, final_eval)
        _save(cfg, run_dir, step, model, trainer, engine, sampler, kl_ctl)
    finally:
        console.stop()
        recorder.close()
    summary = finish_run(cfg, run_dir, first_eval, final_eval, history, start_step, time.time() - started, console)
    return RunResult(run_dir=run_dir, summary=summary, history=history)


def rl_step(cfg, step, sampler, engine, tokenizer, scorer, trainer, kl_ctl, params, guards, recorder) -> dict:
    """One synchronous step: rollout, reward, advantages, update. Returns its metrics."""
    t0 = time.perf_counter()
    n = cfg.rollout.n
    prompts, completions, scored, rounds = _rollout_and_score(cfg, sampler, engine, tokenizer, scorer, params)
    t_rollout = time.perf_counter() - t0
    scores = [
        cfg.rollout.truncated_reward if c.truncated and cfg.rollout.truncated_reward is not None else s
        for c, s in zip(completions, scored.scores, strict=True)
    ]
    batch = collate(completions, scores, tokenizer.pad_token_id)
    health = rollout_health(completions, batch.scores, batch.group)
    dropped = sorted(set(scored.invalid_rows) | set(guards.check_rewards(scores)))
    if dropped:
        batch.response_mask[dropped] = 0.0  # a NaN / Inf reward never reaches the optimizer
        recorder.count_guard("nonfinite_reward")
    batch.old_logprobs = trainer.old_logprobs(batch)
    batch.ref_logprobs = trainer.ref_logprobs(batch)
    kl_value = _advantages(cfg, batch, kl_ctl)
    stats = trainer.update(batch, beta=kl_ctl.beta if cfg.algo.kl.placement == "loss" else 0.0)
    if stats.get("skipped"):
        guards.check_update(stats.get("loss", math.nan), stats.get("grad_norm", math.nan))
        recorder.count_guard("nonfinite_update")
    kl_ctl.update(kl_value, len(batch))
    elapsed = time.perf_counter() - t0
    tokens = float(batch.response_mask.sum())
    return {
        **health,
        **{k: v for k, v in stats.items() if k not in ("updates",)},
        "kl": kl_value,
        "beta": kl_ctl.beta,
        "logprob_gap": logprob_gap(batch.rollout_logprobs, batch.old_logprobs, batch.response_mask),
        "invalid_rewards": float(scored.invalid + len(dropped)),
        "rollout_tps": tokens / max(t_rollout, 1e-9),
        "step_seconds": elapsed,
        "rollout_utilization": t_rollout / max(elapsed, 1e-9),
        "train_utilization": 1.0 - t_rollout / max(elapsed, 1e-9),
        "sample_lag": 0.0,
        "sample_drop_ratio": len(dropped) / len(batch),
        "policy_version": float(engine.version),
        "prompts": float(len(batch) // max(n, 1)),
        "sampling_rounds": float(rounds),
        **{f"reward/{k}": _nanmean(v) for k, v in scored.components.items()},
    }


def _rollout_and_score(cfg, sampler, engine, tokenizer, scorer, params):
    """Sample prompts and completions and score them.

    With DAPO dynamic sampling, groups whose rewards are all equal carry no
    gradient: they are dropped and more prompts are sampled, up to
    ``algo.max_sampling_rounds`` rounds; the kept groups are what trains.
    """
    n = cfg.rollout.n
    kept_p, kept_c, kept_s = [], [], ScoredBatch(scores=[])
    rounds = 0
    while rounds < (cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 1):
        rounds += 1
        prompts = sampler.next_batch()
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        completions = engine.generate(ids, params, n=n, group_offset=len(kept_p))
        scored = scorer.score(to_reward_samples(prompts, completions, n, params.max_tokens))
        keep = range(len(prompts))
        if cfg.algo.dynamic_sampling:
            keep = [i for i in keep if len(set(scored.scores[i * n : (i + 1) * n])) > 1]
        for i in keep[: cfg.rollout.prompts_per_step - len(kept_p)]:
            rows = range(i * n, (i + 1) * n)
            c = [completions[r] for r in rows]
            for x in c:
                x.group = len(kept_p)
            kept_p.append(prompts[i])
            kept_c.extend(c)
            _extend_scored(kept_s, scored, rows)
        if len(kept_p) >= cfg.rollout.prompts_per_step:
            break
    if not kept_p:  # every group was flat in every round: train on the last round (zero advantage)
        kept_p, kept_c, kept_s = prompts, completions, scored
    return kept_p, kept_c, kept_s, rounds


def _extend_scored(into: ScoredBatch, src: ScoredBatch, rows) -> None:
    base = len(into.scores)
    for j, r in enumerate(rows):
        into.scores.append(src.scores[r])
        if r in src.invalid_rows:
            into.invalid_rows.append(base + j)
            into.invalid += 1
    for name, values in src.components.items():
        into.components.setdefault(name, []).extend(values[r] for r in rows)


def _advantages(cfg: Config, batch: TrainBatch, kl_ctl) -> float:
    """Fill token_level_rewards, advantages and returns; returns the mean KL to the reference."""
    mask = batch.response_mask
    rewards = scores_to_token_rewards(batch.scores, mask)
    kl_value = 0.0
    if batch.ref_logprobs is not None:
        if cfg.algo.kl.placement == "reward":
            rewards, kl_t = kl_penalized_rewards(
                rewards, batch.old_logprobs, batch.ref_logprobs, mask,
                beta=kl_ctl.beta, estimator=cfg.algo.kl.estimator,
            )
            kl_value = float(kl_t)
        else:
            kl_t = get_kl_estimator(cfg.algo.kl.estimator)(batch.old_logprobs, batch.ref_logprobs)
            kl_value = float(masked_mean(kl_t, mask))
    batch.token_level_rewards = rewards
    estimator = get_advantage_estimator(cfg.algo.advantage)
    batch.advantages, batch.returns = estimator(
        rewards, mask, batch.group, values=batch.values, **cfg.algo.advantage_params
    )
    return kl_value


def _save(cfg, run_dir, step, model, trainer, engine, sampler, kl_ctl) -> None:
    state = {
        "trainer": trainer.state_dict(),
        "sampler": sampler.state_dict(),
        "kl_ctl": kl_ctl.state_dict(),
        "engine_generator": engine.generator.get_state(),
    }
    save_checkpoint(run_dir, step, model, state, ref_model=trainer.ref_model, keep=cfg.checkpoint.keep)


def _restore(ckpt: Path, model, trainer, engine, sampler, kl_ctl) -> int:
    from rlpost.models.loading import load_causal_lm

    state = load_state(ckpt)
    model.load_state_dict(load_causal_lm(ckpt / "model").state_dict())
    if trainer.ref_model is not None and (ckpt / "ref_model").is_dir():
        trainer.ref_model.load_state_dict(load_causal_lm(ckpt / "ref_model").state_dict())
    trainer.load_state_dict(state["trainer"])
    sampler.load_state_dict(state["sampler"])
    kl_ctl.load_state_dict(state["kl_ctl"])
    engine.generator.set_state(state["engine_generator"])
    set_rng_state(state["rng"])
    return int(state["step"])


def _carry_out(action, cfg, run_dir, step, model, trainer, engine, sampler, kl_ctl, channel):
    """Apply one guard action; returns (step to continue from, new good-checkpoint step or None)."""
    if action.kind == "stop":
        raise TrainingStopped(f"stopped by guard {action.guard}: {action.reason}")
    if action.kind == "raise_beta":
        kl_ctl.beta = kl_ctl.beta * (action.factor or 2.0) if kl_ctl.beta > 0 else 0.01
    elif action.kind == "lower_lr":
        trainer.scale_lr(action.factor or 0.5)
    elif action.kind == "rebuild_engine":
        engine.reset_stats()
        channel.push(model, version=step)
    elif action.kind == "rollback":
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            return step, None
        lr_scale = trainer.scheduler.base_lrs
        restored = _restore(ckpt, model, trainer, engine, sampler, kl_ctl)
        trainer.scheduler.base_lrs = lr_scale  # keep LR reductions made since the checkpoint
        channel.push(model, version=restored)
        return restored, restored
    return step, None


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")
