"""The synchronous RL loop, top to bottom: the two stages, composed.

    prompts --rollout_stage--> scored groups --train_stage--> weights v+1 --sync--> rollout serves v+1
            --> held-out eval, guards, checkpoint

The loop drives three workers (trainer, rollout, reward) through their
protocols (``pipeline/workers.py``) and never touches a model, an optimizer or
a random generator, so ``cluster`` can put each worker in this process, in
another process or in a Ray actor. The trainer owns the weights' version; the
engine stamps it on every token it samples.

Every step is synchronous (the engine always serves the newest weights), so
the trainer's old logprobs and the engine's differ only by numerics; the gap
is logged each step as a sync / precision check. The one exception is partial
rollout (``rollout.partial``): samples a step did not wait for carry on into
the next, so their first tokens come from older weights (``sample_lag``), and
the losses' ``tis_cap`` corrects with a truncated importance weight. Loops
that overlap rollout and training reuse the two stages in their own module.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlpost.algos import KLCoefficient
from rlpost.config import Config
from rlpost.data import PromptSampler
from rlpost.data.sources import make_sampler
from rlpost.errors import WorkerError, one_line
from rlpost.observe import Guards, Recorder
from rlpost.observe.memory import bound_kernel_caches, set_mmap_threshold
from rlpost.observe.metrics import merge_metrics
from rlpost.observe.threads import start_threads
from rlpost.pipeline import build, rules
from rlpost.pipeline.console import Console
from rlpost.pipeline.eval_sets import held_out_eval, per_set_summary
from rlpost.pipeline.feeds import (
    OverlapFeed,
    PromptSource,
    RolloutFailed,
    SyncFeed,
)
from rlpost.pipeline.learnability import LearnabilityCheck
from rlpost.pipeline.memory import check_memory, summary_fields
from rlpost.pipeline.rundir import finish_run, prepare_run_dir, warm_start
from rlpost.pipeline.source_metrics import source_metrics
from rlpost.pipeline.stages import RolloutSettings, TrainSettings, invalid_rows, train_stage
from rlpost.pipeline.streaming import stream_samplers, update_data_report
from rlpost.pipeline.weights import WeightPath, build_weight_path
from rlpost.pipeline.workers import Workers
from rlpost.registry import UserCodeError
from rlpost.resolved import RunFacts, resolve
from rlpost.rewards.monitor import HackingMonitor
from rlpost.rewards.scorer import SampleWriter, probe_terms, reward_samples
from rlpost.rng import set_rng_state
from rlpost.sync import SyncError
from rlpost.train.checkpoint import latest_step, load_state, save_checkpoint, usable_checkpoint
from rlpost.types import Group, ScoredBatch

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    history: list[dict] = field(default_factory=list)


class TrainingStopped(RuntimeError):
    """A guard stopped the run after its retries were spent."""


class EmptyStep(RuntimeError):
    """Every sample of a step's rollout failed (harness, engine or reward): nothing to train."""


EMPTY_STEPS_IN_A_ROW = 3
"""Empty steps in a row after which the run stops: a rollout side that fails every sample is
broken, not unlucky."""


@dataclass
class Run:
    """The loop's own state (workers aside): data order, KL controller, guards, outputs."""

    cfg: Config
    run_dir: Path
    w: Workers
    sampler: PromptSampler
    kl_coef: KLCoefficient
    guards: Guards
    recorder: Recorder
    samples: SampleWriter
    monitor: HackingMonitor
    pad_id: int
    eos_id: int
    facts: RunFacts  # derived run facts (the step plan among them), resolved once
    train: TrainSettings  # what the train stage reads, its estimator bound once
    feed: object = None
    weights: WeightPath | None = None  # the one thing that moves weights (pipeline/weights.py)
    on_groups: Callable | None = None
    learn: LearnabilityCheck | None = None  # "cannot learn" warnings at the first steps
    eval_seconds: float = 0.0  # wall time spent in held-out evaluation
    console: Console | None = None  # held-out evaluation shows its progress here
    gap_noted: bool = False  # the engine/trainer logprob gap was reported (once a run)


def start_workers(cfg: Config, run_dir: Path, train_prompts, console, *, resuming: bool) -> Workers:
    """Workers in this process: warm-up, then the trainer around the starting policy, the
    rollout worker serving a copy of it (or its memory: RunFacts.shares_storage), and
    the reward worker."""
    facts = resolve(cfg)
    model, tokenizer = warm_start(cfg, run_dir, train_prompts, console, skip_sft=resuming)
    # a copy, before any adapters; the weight path sends it its first weights
    rollout = build.build_rollout_worker(cfg, model, tokenizer, serve=False, facts=facts)
    trainer = build.build_trainer_worker(cfg, model, tokenizer, facts=facts)
    teacher = build.build_teacher_worker(cfg, facts, tokenizer)  # checked against its tokenizer
    return Workers(trainer, rollout, build.build_reward_worker(cfg), teacher=teacher)


def train(
    cfg: Config,
    *,
    resume: Path | None = None,
    console: Console | None = None,
    stop: threading.Event | None = None,
    start: Callable[..., Workers] | None = None,
    on_groups: Callable[[int, list[Group]], None] | None = None,
) -> RunResult:
    """Run the loop. ``stop``, when set from another thread, ends the run after the current
    step (final eval, checkpoint and summary still happen). ``start`` places the workers
    (a ``rlpost.cluster`` backend); by default they are built in this process.
    ``on_groups(step, groups)`` sees every step's trained groups (tools and tests)."""
    rules.check(cfg, "train")
    facts = resolve(cfg)
    memory = check_memory(cfg)  # before the run directory is touched
    build.check_teacher(cfg, facts)  # likewise
    run_dir, train_prompts, held_out = prepare_run_dir(cfg, resume)  # the one data load
    probe_terms(cfg.reward, cfg.data.sources, train_prompts)  # the user's rewards, on two rows
    console = console or Console(enabled=cfg.observe.progress)
    torch.manual_seed(cfg.run.seed)
    follower = start_threads(cfg.run.threads, torch.set_num_threads)  # None unless 0
    set_mmap_threshold(cfg.run.malloc_mmap_threshold)
    bound_kernel_caches()  # a library caller's process, where no kernel was built yet
    started = time.time()
    if cfg.eval.limit and not cfg.eval.sets:  # eval.sets: applied to each set at load
        held_out = held_out[: cfg.eval.limit]
    ckpt = usable_checkpoint(run_dir) if resume else None
    start = start or start_workers
    workers = start(cfg, run_dir, train_prompts, console, resuming=ckpt is not None)
    with contextlib.ExitStack() as closing:  # a failed start, too, releases what it started
        closing.callback(workers.close)
        r = _new_run(cfg, facts, run_dir, workers, train_prompts, ckpt)
        closing.callback(r.recorder.close)
        closing.callback(console.stop)
        r.on_groups, r.console = on_groups, console
        r.weights = build_weight_path(cfg, workers.rollout, run_dir)
        closing.callback(r.weights.close)
        closing.callback(lambda: r.feed is not None and r.feed.close())
        step, pending = _restore(r, ckpt) if ckpt is not None else (_push(r), [])
        r.weights.take_sent()  # the starting weights are no step's sync
        r.learn = learnability_check(cfg, facts, workers) if ckpt is None else None
        start_step, history, rl_seconds, empty = step, [], 0.0, 0
        first_eval = _full_eval(r, held_out)
        console.note_eval(step, first_eval)
        r.recorder.record(step, first_eval)
        console.start(cfg.train.steps, step)
        r.feed = _feed(r, PromptSource(r.sampler, pending), step)
        while step < cfg.train.steps and not (stop is not None and stop.is_set()):
            t0 = time.perf_counter()
            try:
                m, actions = rl_step(r, step)
                due = step + 1 >= cfg.train.steps or _eval_due(cfg, step + 1)
                if due or (step + 1) % cfg.sync.every == 0:
                    m = merge_metrics(m, r.feed.push(r.w.trainer.export_weights()))
                else:  # sync.every > 1: the engine keeps serving an older version
                    m = merge_metrics(m, {"sync_seconds": 0.0, "sync_bytes": 0.0})
            except (RolloutFailed, WorkerError, UserCodeError, SyncError) as exc:
                _stop_on_lost_worker(r, step, exc)
            except EmptyStep as exc:  # counted, and the step drawn again from new prompts
                empty = _count_empty_step(r, step, exc, empty)
                continue
            empty = 0
            step += 1
            rl_seconds += time.perf_counter() - t0
            if follower is not None:
                follower.after_step()
            if _eval_due(cfg, step):
                r.feed.pause()
                m = merge_metrics(m, _eval(r, held_out, greedy=False))
                r.feed.resume()
            if r.learn is not None:
                r.learn.after_step(step, m, r.w)
            r.recorder.record(step, m)
            history.append({"step": step, **m})
            console.update(step, m)
            for action in actions + r.guards.after_step(m):
                r.recorder.count_guard(action.guard)
                step = _carry_out(r, action, step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                r.feed.pause()  # the sampler's cursor and the batches ahead, as one snapshot
                _save(r, step)
                r.feed.resume()
        r.feed.close()
        final_eval = _full_eval(r, held_out)
        r.recorder.record(step, final_eval)
        _save(r, step)
    wall = time.time() - started
    trained = sum(h.get("completions", 0.0) for h in history)
    pace = {
        "rl_seconds": rl_seconds,
        "completions_per_second": trained / max(rl_seconds, 1e-9),
        "threads": torch.get_num_threads(),  # run.threads=0: the count after the last step
        "eval_seconds": r.eval_seconds,
        "eval_share": r.eval_seconds / max(wall, 1e-9),
    }
    if cfg.eval.sets:
        pace["eval_sets"] = per_set_summary(cfg, first_eval, final_eval)
    if "eval_tool_call_rate" in first_eval:  # multi-turn episodes: tool use before and after RL
        pace["eval_tool_call_rate_start"] = first_eval["eval_tool_call_rate"]
        pace["eval_tool_call_rate_end"] = final_eval.get("eval_tool_call_rate")
    extra = pace | summary_fields(memory)
    summary = finish_run(
        cfg, run_dir, first_eval, final_eval, history, start_step, wall, console, extra=extra
    )
    return RunResult(run_dir=run_dir, summary=summary, history=history)


def learnability_check(cfg: Config, facts: RunFacts, workers: Workers) -> LearnabilityCheck:
    check = LearnabilityCheck(
        max_tokens=cfg.rollout.max_tokens,
        truncated_reward=cfg.rollout.truncated_reward,
        group_relative=facts.group_relative,
    )
    check.start(workers)
    return check


def _eval_due(cfg: Config, step: int) -> bool:
    return bool(cfg.eval.every) and step % cfg.eval.every == 0 and step < cfg.train.steps


def _count_empty_step(r: Run, step: int, exc: EmptyStep, in_a_row: int) -> int:
    """Count an empty step (a guard action, a log line); stop the run in one line once
    :data:`EMPTY_STEPS_IN_A_ROW` came in a row."""
    in_a_row += 1
    r.recorder.count_guard("empty_step")
    log.warning("step %d: %s; drawing new prompts (%d in a row)", step + 1, exc, in_a_row)
    if in_a_row >= EMPTY_STEPS_IN_A_ROW:
        raise TrainingStopped(
            f"step {step + 1}: {exc}, {in_a_row} steps in a row; fix the rollout side "
            f"(the harness, engine or reward) and continue with rlpost train --resume {r.run_dir}"
        )
    return in_a_row


def _stop_on_lost_worker(r: Run, step: int, exc: Exception) -> None:
    """A lost rollout side: checkpoint what trained and stop in one line (a lost trainer
    cannot checkpoint: the last saved one stands)."""
    why = one_line(exc)
    if isinstance(exc, WorkerError) and exc.role == "trainer":
        raise TrainingStopped(
            f"trainer worker lost at step {step} ({why}); continue from the last checkpoint "
            f"with rlpost train --resume {r.run_dir}"
        ) from None
    r.feed.close()
    step = r.w.trainer.version()  # the update of the failing step may have gone through
    _save(r, step, rollout_state=False)
    raise TrainingStopped(
        f"rollout stopped at step {step} ({why}); checkpoint saved, continue with "
        f"rlpost train --resume {r.run_dir}"
    ) from None


def _feed(r: Run, source: PromptSource, step: int):
    """The rollout feed of ``pipeline.mode``: generated on demand, or by a producer ahead."""
    cfg, p = r.cfg, r.cfg.pipeline
    settings = RolloutSettings(
        n=cfg.rollout.n,
        prompts_per_step=cfg.rollout.prompts_per_step,
        dynamic_sampling=cfg.algo.dynamic_sampling,
        max_sampling_rounds=cfg.algo.max_sampling_rounds,
        partial=cfg.rollout.partial,
        greedy_baseline=r.facts.plan.greedy_baseline,
    )
    params = build.sampling_params(cfg, r.eos_id)
    if p.mode == "sync":
        return SyncFeed(r.w.rollout, r.w.reward, source, params, settings, weights=r.weights)
    one_step_off = p.mode == "one_step_off"
    return OverlapFeed(
        r.w.rollout,
        r.w.reward,
        source,
        params,
        settings,
        eta=1 if one_step_off else p.max_staleness,
        queue_batches=1 if one_step_off else p.queue_batches,
        stale=p.stale,
        first_step=step,
        version=r.w.rollout.version(),
        total_steps=cfg.train.steps,
        # async runs the continuous engine, which takes weights between decode steps;
        # one_step_off keeps the batch engine and swaps weights between batches.
        defer_weights=one_step_off,
        weights=r.weights,
    )


def _new_run(
    cfg: Config, facts: RunFacts, run_dir: Path, workers: Workers, train_prompts, ckpt
) -> Run:
    kl = cfg.algo.kl
    info = workers.trainer.describe()
    if workers.teacher is None:  # a backend that placed none: the teacher runs here
        workers.teacher = build.build_teacher_worker(cfg, facts)
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        w=workers,
        sampler=make_sampler(
            train_prompts,
            cfg.data.sources,
            cfg.rollout.prompts_per_step,
            cfg.run.seed,
            streams=stream_samplers(cfg),
        ),
        kl_coef=KLCoefficient(kl.beta, kl.placement, kl.target or None, kl.horizon),
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
        pad_id=int(info["pad_token_id"]),
        eos_id=int(info["eos_token_id"]),
        facts=facts,
        train=TrainSettings(cfg.algo, facts.plan, workers.teacher),
    )


def rl_step(r: Run, step: int) -> tuple[dict, list]:
    """One step: the feed's rollout stage output, then the train stage. Returns (metrics,
    guard actions)."""
    cfg = r.cfg
    t0 = time.perf_counter()
    fed = r.feed.next(step, r.w.trainer.version(), last=step + 1 >= cfg.train.steps)
    out = fed.out
    if not any(g.completions for g in out.groups):
        why = [f"{k}={v:g}" for k, v in out.stats.items() if v and ("fail" in k or "timed" in k)]
        why = "; ".join(why + [f"first session: {out.why}"] * bool(out.why)) or "no rows"
        raise EmptyStep(f"every sample of {len(out.groups)} prompts failed ({why})")
    if r.on_groups is not None:
        r.on_groups(step + 1, out.groups)
    _write_samples(r, step + 1, out.groups)
    stats = train_stage(
        out.groups,
        r.w.trainer,
        r.train,
        pad_id=r.pad_id,
        kl_coef=r.kl_coef,
        guards=r.guards,
        step=step,
    )
    m = stats.metrics
    note_logprob_gap(r, m, step + 1)
    if m["invalid_rewards"]:
        r.recorder.count_guard("nonfinite_reward")
    elapsed = time.perf_counter() - t0
    verifiable = r.w.reward.verifiable_accuracy(out.groups)
    flags = r.monitor.update(m["reward_mean"], verifiable, m["response_length_mean"])
    busy = out.seconds if cfg.pipeline.mode == "sync" else fed.stats["trainer_wait_seconds"]
    own = {
        "rollout_tps": out.generated / max(out.seconds, 1e-9),  # sampled, dropped included
        "step_seconds": elapsed,
        "rollout_utilization": out.seconds / max(elapsed, 1e-9),
        "train_utilization": 1.0 - busy / max(elapsed, 1e-9),
        "mfu": r.w.trainer.mfu(stats.attended, stats.seq_len, elapsed - busy),
        "prompts": float(len(out.groups)),
        "sample_drop_ratio": _drop_ratio(m, fed.stats.get("stale_dropped", 0.0)),
        "sampling_rounds": float(out.rounds),
        "verifiable_accuracy": verifiable if verifiable is not None else math.nan,
        "hacking_flags": float(len(flags)),
    }
    components = {f"reward/{k}": _nanmean(v) for k, v in _components(out.groups).items()}
    sources = source_metrics(out.groups) | reward_counts(r)
    return merge_metrics(m, fed.stats, own, out.stats, components, sources), stats.actions


LOGPROB_GAP_NOTE = 0.01
"""Mean engine-trainer logprob gap, nats a token on the same weights, above which a run
without a rollout correction says so (SmolLM2-135M: 1e-5 in float32; in bf16 0.038 from an
engine wholly in bf16, 0.016 from one with the trainer's numerics, docs/performance.md)."""


def note_logprob_gap(r: Run, m: dict, step: int) -> None:
    """Say once, in one line, that the engine samples from another distribution than the
    trainer scores (a different dtype or kernels) when nothing corrects for it."""
    if r.gap_noted or r.cfg.algo.rollout_correction.name != "none" or m["sample_lag_max"]:
        return
    if m["logprob_gap"] > LOGPROB_GAP_NOTE:
        r.gap_noted = True
        log.warning(
            "logprob_gap=%.3f at step %d: the engine samples from another policy than the "
            "trainer scores (nats a token, same weights); set algo.rollout_correction.name=tis "
            "to correct for it",
            m["logprob_gap"],
            step,
        )


def reward_counts(r: Run) -> dict[str, float]:
    """The reward worker's running counts (invalid scores, scorer errors) of a mixture run,
    as ``reward_count/<term>/<count>`` ({} for one source)."""
    if not r.cfg.data.sources:
        return {}
    return {f"reward_count/{k}": float(v) for k, v in r.w.reward.counters().items()}


def _drop_ratio(m: dict, stale: float) -> float:
    """Samples not trained (invalid rewards, too stale) over samples generated for the step."""
    return (m["invalid_rewards"] + stale) / max(m["completions"] + stale, 1.0)


def _components(groups) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for g in groups:
        for name, values in g.components.items():
            out.setdefault(name, []).extend(values)
    return out


def _write_samples(r: Run, step: int, groups) -> None:
    if not r.samples.due(step):
        return
    flat = [s for g in groups for s in g.scores]
    invalid = invalid_rows(groups)
    scored = ScoredBatch(flat, _components(groups), len(invalid), invalid)
    completions = [c for g in groups for c in g.completions]
    samples = reward_samples(groups, r.cfg.rollout.max_tokens)
    r.samples.maybe_write(step, samples, scored, completions)


def _push(r: Run) -> int:
    """Serve the trainer's weights through the run's weight path while no feed is running
    (start, restore); returns their version. With a feed running, ``feed.push`` does it."""
    export = r.w.trainer.export_weights()
    r.weights.push(export)
    return export.version


def _eval(r: Run, held_out, *, greedy: bool) -> dict:
    t0 = time.perf_counter()
    console = r.console or Console(enabled=False)
    out = held_out_eval(r.cfg, r.w.rollout, r.w.reward, held_out, r.eos_id, console, greedy=greedy)
    r.eval_seconds += time.perf_counter() - t0
    return out


def _full_eval(r: Run, held_out) -> dict:
    """Held-out metrics at the eval temperature, plus greedy accuracy when that differs."""
    out = _eval(r, held_out, greedy=False)
    if r.cfg.eval.sets:
        return out
    if r.cfg.eval.temperature > 0 and held_out:
        greedy = _eval(r, held_out, greedy=True)
        out["eval_greedy_accuracy"] = greedy["eval_accuracy"]
        out["eval_greedy_accuracy_stderr"] = greedy["eval_accuracy_stderr"]
    return out


def _save(r: Run, step: int, *, rollout_state: bool = True) -> None:
    state = {
        "sampler": r.sampler.state_dict(),
        "kl_ctl": r.kl_coef.state_dict(),
        "rollout": r.w.rollout.state_dict() if rollout_state else None,
        # prompts drawn but not trained yet (running ahead): a resume generates them first
        "pending": r.feed.pending() if r.feed is not None else [],
    }
    save_checkpoint(r.run_dir, step, r.w.trainer.save, state, keep=r.cfg.checkpoint.keep)
    update_data_report(r.run_dir, r.sampler)  # the rows streamed sources met so far


def _restore(r: Run, ckpt: Path, *, keep_lr: bool = False) -> tuple[int, list]:
    """Load a checkpoint into every worker; the rollout worker then serves its weights.
    Returns the step and the prompt batches that were drawn but not trained."""
    state = load_state(ckpt)
    step = int(state["step"])
    r.w.trainer.restore(ckpt, version=step, keep_lr=keep_lr)
    r.sampler.load_state_dict(state["sampler"])
    r.kl_coef.load_state_dict(state["kl_ctl"])
    if state["rollout"] is not None:  # None: saved after the rollout worker was lost
        r.w.rollout.load_state_dict(state["rollout"])
    set_rng_state(state["rng"])
    r.weights.restart_versions()  # the version numbers after ``step`` are reused from here
    _push(r)
    return step, state.get("pending", [])


def _carry_out(r: Run, action, step: int) -> int:
    """Apply one guard action; returns the step to continue from."""
    if action.kind == "stop":
        raise TrainingStopped(f"stopped by guard {action.guard}: {action.reason}")
    if action.kind == "raise_beta":
        r.kl_coef.raise_by(action.factor or 2.0)
    elif action.kind == "lower_lr":
        r.w.trainer.scale_lr(action.factor or 0.5)
    elif action.kind == "rebuild_engine":
        r.w.rollout.reset_stats()
        # through the feed, which (one_step_off) holds them until the batch in flight ends
        r.feed.push(r.w.trainer.export_weights(), report=False)
    elif action.kind == "rollback":
        ckpt = usable_checkpoint(r.run_dir)
        if ckpt is not None:
            r.feed.close()
            step, pending = _restore(r, ckpt, keep_lr=True)  # keep LR cuts made since
            r.feed = _feed(r, PromptSource(r.sampler, pending), step)
    return step


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")
