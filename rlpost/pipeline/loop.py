"""The on-policy RL loop, top to bottom.

    prompts --rollout--> completions --rewards--> scores --algos--> advantages
            --train--> weights v+1 --sync--> engine serves v+1 --> held-out eval, checkpoint

Every step is synchronous (the engine always serves the newest weights), so
the trainer's old logprobs and the engine's differ only by numerics; the gap
is logged each step as a sync / precision check. The one exception is partial
rollout (``rollout.partial``): samples a step did not wait for carry on into
the next, so their first tokens come from older weights. ``sample_lag`` counts
how many versions behind; the losses' ``tis_cap`` corrects with a truncated
importance weight between engine and trainer. Async variants belong in their
own module, not behind flags here.
"""

from __future__ import annotations

import logging
import math
import threading
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
from rlpost.rewards.monitor import HackingMonitor
from rlpost.rewards.samples import SampleWriter
from rlpost.rewards.scorer import build_scorer
from rlpost.rollout.longtail import LengthPredictor, PartialRollout, bucket_by_length
from rlpost.sync import InProcessChannel
from rlpost.train.batch import TrainBatch, collate
from rlpost.train.checkpoint import (
    latest_checkpoint,
    latest_step,
    load_state,
    save_checkpoint,
    set_rng_state,
)
from rlpost.types import ScoredBatch

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    history: list[dict] = field(default_factory=list)


class TrainingStopped(RuntimeError):
    """A guard stopped the run after its retries were spent."""


@dataclass
class Parts:
    """Everything a step touches, built once by :func:`train`."""

    cfg: Config
    run_dir: Path
    model: torch.nn.Module
    tokenizer: object
    trainer: object
    engine: object
    channel: InProcessChannel
    scorer: object
    sampler: PromptSampler
    kl_ctl: object
    guards: Guards
    recorder: Recorder
    samples: SampleWriter
    monitor: HackingMonitor
    params: object
    critic: object = None
    partial: PartialRollout | None = None
    lengths: LengthPredictor | None = None
    rollout_stats: dict = field(default_factory=dict)


def train(
    cfg: Config,
    *,
    resume: Path | None = None,
    console: Console | None = None,
    stop: threading.Event | None = None,
) -> RunResult:
    """Run the on-policy loop. ``stop``, when set from another thread, ends the run after the
    current step (final eval, checkpoint and summary still happen)."""
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
    engine = build.build_engine(cfg, model, tokenizer)
    kl = cfg.algo.kl
    p = Parts(
        cfg=cfg,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        trainer=build.build_trainer(cfg, model),
        engine=engine,
        channel=InProcessChannel(engine),
        scorer=build_scorer(cfg.reward),
        sampler=PromptSampler(train_prompts, cfg.rollout.prompts_per_step, seed=cfg.run.seed),
        kl_ctl=AdaptiveKLController(kl.beta, kl.target, kl.horizon)
        if kl.target
        else FixedKLController(kl.beta),
        guards=Guards(cfg.observe.guards),
        recorder=Recorder(
            run_dir,
            prometheus_port=cfg.observe.prometheus.port,
            prometheus_host=cfg.observe.prometheus.host,
            tensorboard=cfg.observe.tensorboard,
            loggers=cfg.observe.loggers,
            start_step=latest_step(ckpt),
        ),
        samples=SampleWriter(run_dir, cfg.reward.sample_every, cfg.reward.sample_count),
        monitor=HackingMonitor(),
        params=build.sampling_params(cfg, tokenizer),
        critic=build.build_critic(cfg, model),
        partial=PartialRollout(
            engine,
            fraction=cfg.rollout.partial_fraction,
            chunk_tokens=cfg.rollout.partial_chunk_tokens,
            tokenizer=tokenizer,
        )
        if cfg.rollout.partial
        else None,
        lengths=LengthPredictor() if cfg.rollout.length_aware else None,
    )
    eval_p = build.eval_params(cfg, tokenizer)
    step, history = 0, []
    if ckpt is not None:
        step = _restore(p, ckpt)
    start_step = step
    try:
        first_eval = _full_eval(p, held_out, eval_p)
        console.note_eval(step, first_eval)
        p.recorder.record(step, first_eval)
        console.start(cfg.train.steps, step)
        while step < cfg.train.steps and not (stop is not None and stop.is_set()):
            m, actions = rl_step(p, step)
            step += 1
            m["sync_seconds"] = p.channel.push(model, version=step).seconds
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                k = cfg.eval.samples
                m.update(evaluate(engine, tokenizer, held_out, p.scorer, eval_p, samples=k))
            p.recorder.record(step, m)
            history.append({"step": step, **m})
            console.update(step, m)
            for action in actions + p.guards.after_step(m):
                p.recorder.count_guard(action.guard)
                step = _carry_out(p, action, step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                _save(p, step)
        final_eval = _full_eval(p, held_out, eval_p)
        p.recorder.record(step, final_eval)
        _save(p, step)
    finally:
        console.stop()
        p.recorder.close()
        p.scorer.close()
        if hasattr(engine, "close"):
            engine.close()
    summary = finish_run(
        cfg, run_dir, first_eval, final_eval, history, start_step, time.time() - started, console
    )
    return RunResult(run_dir=run_dir, summary=summary, history=history)


def _full_eval(p: Parts, held_out, params) -> dict:
    """Held-out metrics at the eval temperature, plus greedy accuracy when that differs."""
    out = evaluate(p.engine, p.tokenizer, held_out, p.scorer, params, samples=p.cfg.eval.samples)
    if params.temperature > 0 and held_out:
        greedy = build.eval_params(p.cfg, p.tokenizer, greedy=True)
        out["eval_greedy_accuracy"] = evaluate(p.engine, p.tokenizer, held_out, p.scorer, greedy)[
            "eval_accuracy"
        ]
    return out


def rl_step(p: Parts, step: int) -> tuple[dict, list]:
    """One synchronous step: rollout, reward, advantages, update. Returns (metrics, guard actions)."""
    cfg = p.cfg
    t0 = time.perf_counter()
    prompts, completions, samples, scored, rounds = _rollout_and_score(
        p, last=step + 1 >= cfg.train.steps
    )
    t_rollout = time.perf_counter() - t0
    scores = [
        cfg.rollout.truncated_reward
        if c.truncated and cfg.rollout.truncated_reward is not None
        else s
        for c, s in zip(completions, scored.scores, strict=True)
    ]
    p.samples.maybe_write(step + 1, samples, scored)
    batch = collate(completions, scores, p.tokenizer.pad_token_id)
    health = rollout_health(completions, batch.scores, batch.group)
    dropped = sorted(set(scored.invalid_rows) | set(p.guards.check_rewards(scores)))
    actions = []
    if dropped:
        batch.response_mask[dropped] = 0.0  # a NaN / Inf reward never reaches the optimizer
        p.recorder.count_guard("nonfinite_reward")
        log.warning(
            "guard nonfinite_reward: drop_samples - %d/%d invalid scores", len(dropped), len(batch)
        )
    # On-policy single-update steps take the old logprobs from the loss pass itself.
    need_old_first = not p.trainer.single_update(len(batch)) or cfg.algo.kl.placement == "reward"
    batch.old_logprobs = p.trainer.old_logprobs(batch) if need_old_first else None
    batch.ref_logprobs = p.trainer.ref_logprobs(batch)
    critic_stats = {}
    if p.critic is not None:
        batch.values = p.critic.values(batch)
    _advantages(cfg, batch, p.kl_ctl)
    if p.critic is not None:
        critic_stats = p.critic.update(batch)
    train_policy = p.critic is None or step >= cfg.critic.warmup_steps
    if batch.old_logprobs is None and not train_policy:
        batch.old_logprobs = p.trainer.old_logprobs(batch)
    beta = p.kl_ctl.beta if cfg.algo.kl.placement == "loss" else 0.0
    stats = p.trainer.update(batch, beta=beta) if train_policy else {}
    if stats:
        bad = p.guards.check_update(stats.get("loss", math.nan), stats.get("grad_norm", math.nan))
        actions += [bad] if bad is not None else []
    kl_value = _kl_to_reference(cfg, batch)
    p.kl_ctl.update(kl_value, len(batch))
    elapsed = time.perf_counter() - t0
    tokens = float(batch.response_mask.sum())
    verifiable = p.scorer.verifiable_accuracy(scored)
    flags = p.monitor.update(health["reward_mean"], verifiable, health["response_length_mean"])
    return {
        **health,
        **{k: v for k, v in stats.items() if k not in ("updates",)},
        **critic_stats,
        "kl": kl_value,
        "beta": p.kl_ctl.beta,
        "logprob_gap": logprob_gap(batch.rollout_logprobs, batch.old_logprobs, batch.response_mask),
        "invalid_rewards": float(len(dropped)),
        "rollout_tps": tokens / max(t_rollout, 1e-9),
        "step_seconds": elapsed,
        "rollout_utilization": t_rollout / max(elapsed, 1e-9),
        "train_utilization": 1.0 - t_rollout / max(elapsed, 1e-9),
        "mfu": p.trainer.mfu(batch, elapsed - t_rollout),
        **_lag(completions, p.engine.version),
        **p.rollout_stats,
        "sample_drop_ratio": len(dropped) / len(batch),
        "policy_version": float(p.engine.version),
        "prompts": float(len(prompts)),
        "sampling_rounds": float(rounds),
        "verifiable_accuracy": verifiable if verifiable is not None else math.nan,
        "hacking_flags": float(len(flags)),
        **{f"reward/{k}": _nanmean(v) for k, v in scored.components.items()},
    }, actions


def _rollout_and_score(p: Parts, last: bool = False):
    """Sample prompts and completions and score them.

    With DAPO dynamic sampling, groups whose rewards are all equal carry no
    gradient: they are dropped and more prompts are sampled, up to
    ``algo.max_sampling_rounds`` rounds; the kept groups are what trains.
    """
    cfg, n = p.cfg, p.cfg.rollout.n
    kept_p, kept_c, kept_r, kept_s = [], [], [], ScoredBatch(scores=[])
    rounds = 0
    p.rollout_stats = {}
    while rounds < (cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 1):
        rounds += 1
        prompts, completions = _generate(p, p.sampler.next_batch(), last)
        samples = to_reward_samples(prompts, completions, n, p.params.max_tokens)
        scored = p.scorer.score(samples)
        keep = list(range(len(prompts)))
        if cfg.algo.dynamic_sampling:
            keep = [i for i in keep if len(set(scored.scores[i * n : (i + 1) * n])) > 1]
        if p.partial is None:  # DAPO fills the batch exactly; finished partial groups all train
            keep = keep[: cfg.rollout.prompts_per_step - len(kept_p)]
        for i in keep:
            rows = range(i * n, (i + 1) * n)
            for r in rows:
                completions[r].group = len(kept_p)
                kept_c.append(completions[r])
                kept_r.append(samples[r])
            kept_p.append(prompts[i])
            _extend_scored(kept_s, scored, rows)
        if len(kept_p) >= cfg.rollout.prompts_per_step:
            break
    if not kept_p:  # every group was flat in every round: train on the last round (zero advantage)
        return prompts, completions, samples, scored, rounds
    return kept_p, kept_c, kept_r, kept_s, rounds


def _generate(p: Parts, prompts: list, last: bool) -> tuple[list, list]:
    """Completions for ``prompts`` (``n`` each, grouped in prompt order); returns (prompts, completions).

    With length-aware batching the prompts go to the engine ordered by predicted
    response length, so each decode batch holds similar lengths. With partial
    rollout the prompts returned are those whose groups finished this step
    (carried ones from earlier steps included); the last step waits for all.
    """
    n = p.cfg.rollout.n
    if p.lengths is not None:
        per_batch = max(1, p.cfg.rollout.batch_size // n)
        buckets = bucket_by_length(prompts, p.lengths, math.ceil(len(prompts) / per_batch))
        prompts = [prompts[i] for b in buckets for i in b]
    ids = [p.tokenizer(x.text, add_special_tokens=False)["input_ids"] for x in prompts]
    if p.partial is None:
        completions = p.engine.generate(ids, p.params, n=n)
    else:
        out = p.partial.step(ids, p.params, n, payloads=prompts, fraction=1.0 if last else None)
        prompts, completions = out.payloads, out.completions
        p.rollout_stats.update(
            carried_samples=float(out.carried_samples),
            carried_groups=float(out.carried_groups),
            partial_done_fraction=out.done_fraction,
        )
    if p.lengths is not None:
        for i, prompt in enumerate(prompts):
            p.lengths.observe(prompt, (len(c.token_ids) for c in completions[i * n : (i + 1) * n]))
    return prompts, completions


def _lag(completions: list, version: int) -> dict[str, float]:
    """Policy versions between the weights that began each sample and the ones being trained."""
    lags = [version - c.policy_version for c in completions] or [0]
    return {"sample_lag": sum(lags) / len(lags), "sample_lag_max": float(max(lags))}


def _extend_scored(into: ScoredBatch, src: ScoredBatch, rows) -> None:
    base = len(into.scores)
    for j, r in enumerate(rows):
        into.scores.append(src.scores[r])
        if r in src.invalid_rows:
            into.invalid_rows.append(base + j)
            into.invalid += 1
    for name, values in src.components.items():
        into.components.setdefault(name, []).extend(values[r] for r in rows)


def _advantages(cfg: Config, batch: TrainBatch, kl_ctl) -> None:
    """Fill token_level_rewards, advantages and returns (KL in the reward when so placed)."""
    mask = batch.response_mask
    rewards = scores_to_token_rewards(batch.scores, mask)
    if batch.ref_logprobs is not None and cfg.algo.kl.placement == "reward":
        rewards, _ = kl_penalized_rewards(
            rewards,
            batch.old_logprobs,
            batch.ref_logprobs,
            mask,
            beta=kl_ctl.beta,
            estimator=cfg.algo.kl.estimator,
        )
    batch.token_level_rewards = rewards
    estimator = get_advantage_estimator(cfg.algo.advantage)
    batch.advantages, batch.returns = estimator(
        rewards, mask, batch.group, values=batch.values, **cfg.algo.advantage_params
    )


def _kl_to_reference(cfg: Config, batch: TrainBatch) -> float:
    """Mean per-token KL of the sampling policy to the reference (the configured estimator)."""
    if batch.ref_logprobs is None or batch.old_logprobs is None:
        return 0.0
    kl = get_kl_estimator(cfg.algo.kl.estimator)(batch.old_logprobs, batch.ref_logprobs)
    return float(masked_mean(kl, batch.response_mask))


def _save(p: Parts, step: int) -> None:
    state = {
        "trainer": p.trainer.state_dict(),
        "sampler": p.sampler.state_dict(),
        "kl_ctl": p.kl_ctl.state_dict(),
        "engine_generator": p.engine.generator.get_state(),
    }
    if p.critic is not None:
        state["critic"] = p.critic.state_dict()
    if p.partial is not None:
        state["partial"] = p.partial.state_dict()
    if p.lengths is not None:
        state["lengths"] = p.lengths.state_dict()
    save_checkpoint(
        p.run_dir,
        step,
        p.model,
        state,
        ref_model=p.trainer.ref_model,
        tokenizer=p.tokenizer,
        keep=p.cfg.checkpoint.keep,
    )


def _restore(p: Parts, ckpt: Path) -> int:
    """Load a checkpoint into every part; the engine then serves the restored weights."""
    from rlpost.models.loading import load_causal_lm

    state = load_state(ckpt)
    p.model.load_state_dict(load_causal_lm(ckpt / "model").state_dict())
    if p.trainer.ref_model is not None and (ckpt / "ref_model").is_dir():
        p.trainer.ref_model.load_state_dict(load_causal_lm(ckpt / "ref_model").state_dict())
    p.trainer.load_state_dict(state["trainer"])
    p.sampler.load_state_dict(state["sampler"])
    p.kl_ctl.load_state_dict(state["kl_ctl"])
    p.engine.generator.set_state(state["engine_generator"])
    if p.critic is not None and "critic" in state:
        p.critic.load_state_dict(state["critic"])
    if p.partial is not None and "partial" in state:
        p.partial.load_state_dict(state["partial"])
    if p.lengths is not None and "lengths" in state:
        p.lengths.load_state_dict(state["lengths"])
    set_rng_state(state["rng"])
    step = int(state["step"])
    p.channel.push(p.model, version=step)
    return step


def _carry_out(p: Parts, action, step: int) -> int:
    """Apply one guard action; returns the step to continue from."""
    if action.kind == "stop":
        raise TrainingStopped(f"stopped by guard {action.guard}: {action.reason}")
    if action.kind == "raise_beta":
        p.kl_ctl.beta = p.kl_ctl.beta * (action.factor or 2.0) if p.kl_ctl.beta > 0 else 0.01
    elif action.kind == "lower_lr":
        p.trainer.scale_lr(action.factor or 0.5)
    elif action.kind == "rebuild_engine":
        p.engine.reset_stats()
        p.channel.push(p.model, version=step)
    elif action.kind == "rollback":
        ckpt = latest_checkpoint(p.run_dir)
        if ckpt is not None:
            base_lrs = p.trainer.scheduler.base_lrs
            step = _restore(p, ckpt)
            p.trainer.scheduler.base_lrs = base_lrs  # keep LR reductions made since the checkpoint
    return step


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")
