"""Where one RL step's time goes, phase by phase, next to each phase's floor.

    python bench/bench_step_profile.py                 # default job's step, tiny and ~25M
    python bench/bench_step_profile.py --quick         # fewer steps (about a minute)
    python bench/bench_step_profile.py --sizes 25M train.micro_batch_size=64

Runs the default recipe (``rlpost/recipes/grpo_arith.yaml``: 64 prompts x 8
samples, 6-token answers, k3 KL to a reference, two optimizer steps per batch)
with the warm-up off, through the real loop (``rlpost.pipeline.loop.train``),
and times every phase with hooks on the real objects (nothing is replaced):

* rollout prefill / decode: the serving model's forward passes (several
  tokens per row: prefill; one: decode); sampling: ``sample_tokens``;
  rollout other: the rest of the engine's generate (Python bookkeeping,
  KV repeats and compaction, detokenising);
* reward: the reward worker's ``score``;
* old/ref logprobs: the trainer's scoring passes;
* forward: the loss passes; backward: the rest of the update but the
  optimizer (backward, batch slicing); optimizer: gradient clipping and AdamW;
* sync: exporting the weights and loading them into the engine;
* logging: the recorder (metrics files, samples);
* other: the rest of the step (collate, advantages, loop bookkeeping).

The floor of a phase is its matmul FLOPs over the machine's measured matmul peak
(as ``rlpost.observe.mfu`` counts them: 2N per forward token plus attention,
6N per trained token), shown at the float32 peak and, where the CPU has native
bf16 (detected), at the bf16 peak. Phases without matmuls have no floor (-).
The first step (warm-up) and the last (no next step to end it) are left out;
shares are of the median step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from model_sizes import QUIET_RUN, SIZES

from rlpost.config import RECIPES_DIR, load_config
from rlpost.observe.mfu import cpu_bf16_native, cpu_flags, flops_per_token, measure_cpu_peak_flops

PHASES = [
    "rollout prefill",
    "rollout decode",
    "sampling",
    "rollout other",
    "reward",
    "old/ref logprobs",
    "forward",
    "backward",
    "optimizer",
    "sync",
    "logging",
    "other",
]


def describe_cpu() -> str:
    """One line: cores, torch's CPU capability, and the bf16 / AMX flags found."""
    flags = sorted(f for f in cpu_flags() if "bf16" in f or f.startswith("amx"))
    return (
        f"cpu: {os.cpu_count()} cores, torch {torch.__version__} "
        f"capability {torch.backends.cpu.get_cpu_capability()}, "
        f"bf16/amx flags: {' '.join(flags) or 'none'}"
    )


class Profile:
    """Seconds and matmul FLOPs per phase, per step (step 0 = before the first step)."""

    def __init__(self) -> None:
        self.step = 0
        self.starts: list[float] = []
        self.seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.flops: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, phase: str, seconds: float, flops: float = 0.0) -> None:
        self.seconds[self.step][phase] += seconds
        self.flops[self.step][phase] += flops

    def timed(self, fn, phase: str, flops=None):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(phase, time.perf_counter() - t0, flops(args, kwargs, out) if flops else 0.0)
            return out

        return wrapper


def model_dims(model) -> tuple[int, int, int]:
    """(matmul parameters N incl. the LM head, layers, hidden) as the MFU probe counts them."""
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    if cfg.tie_word_embeddings:  # the tied head is a matmul the embedding lookup is not
        n += cfg.vocab_size * cfg.hidden_size
    return n, cfg.num_hidden_layers, cfg.hidden_size


def instrument(prof: Profile, workers) -> None:
    """Hooks on the real workers' objects; each adds its phase's time (and FLOPs)."""
    from rlpost.rollout.engines import hf as hf_engine
    from rlpost.rollout.engines import scheduler
    from rlpost.train import actor

    engine = workers.rollout.engine
    serving = engine.model if hasattr(engine, "model") else engine.scheduler.model
    n, layers, hidden = model_dims(serving)
    t_fwd: dict[int, float] = {}

    def pre(module, args, kwargs):
        t_fwd[0] = time.perf_counter()

    def post(module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows, width = ids.shape
        mask = kwargs.get("attention_mask")
        ctx = mask.shape[1] if mask is not None else width
        if width > 1:
            tokens = float(mask.sum()) if mask is not None else float(ids.numel())
            fl = tokens * flops_per_token(n, layers, hidden, ctx, training=False)
            prof.add("rollout prefill", time.perf_counter() - t_fwd[0], fl)
        else:
            fl = rows * (2.0 * n + 2.0 * layers * hidden * ctx)  # one new token over ctx keys
            prof.add("rollout decode", time.perf_counter() - t_fwd[0], fl)

    serving.register_forward_pre_hook(pre, with_kwargs=True)
    serving.register_forward_hook(post, with_kwargs=True)
    for module in (hf_engine, scheduler):
        module.sample_tokens = prof.timed(module.sample_tokens, "sampling")
    workers.rollout.generate = prof.timed(workers.rollout.generate, "rollout")
    workers.reward.score = prof.timed(workers.reward.score, "reward")

    trainer = workers.trainer.trainer
    tn, tl, th = model_dims(trainer.model)

    def pass_flops(training: bool):
        def count(args, kwargs, out):
            if out is None:
                return 0.0
            batch = args[0]
            seq = batch.input_ids.shape[1]
            return float(batch.attention_mask.sum()) * flops_per_token(
                tn, tl, th, seq, training=training
            )

        return count

    workers.trainer.logprobs = prof.timed(
        workers.trainer.logprobs, "old/ref logprobs", pass_flops(False)
    )

    def micro_flops(args, kwargs, out):
        micro = args[0]
        seq = micro.input_ids.shape[1]
        return float(micro.attention_mask.sum()) * flops_per_token(tn, tl, th, seq, training=False)

    trainer._micro_loss = prof.timed(trainer._micro_loss, "forward", micro_flops)
    # Timing the step wraps it, which the LR scheduler notices and warns about.
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step")
    trainer.optimizer.step = prof.timed(trainer.optimizer.step, "optimizer")
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = prof.timed(clip, "optimizer")

    def update_flops(args, kwargs, out):  # the backward's 4N per token (the forward counted 2N)
        batch = args[0]
        seq = batch.input_ids.shape[1]
        train = flops_per_token(tn, tl, th, seq, training=True)
        fwd = flops_per_token(tn, tl, th, seq, training=False)
        return float(batch.attention_mask.sum()) * (train - fwd) * trainer.s.epochs

    workers.trainer.update = prof.timed(workers.trainer.update, "update", update_flops)
    workers.trainer.export_weights = prof.timed(workers.trainer.export_weights, "sync")
    workers.rollout.load_weights = prof.timed(workers.rollout.load_weights, "sync")
    del actor


def peaks(threads: int) -> tuple[float, float | None]:
    """Matmul peak FLOP/s (fp32, and bf16 where native) at ``threads`` (0: torch's default)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    peak32 = measure_cpu_peak_flops(1024, 5)
    peak16 = measure_cpu_peak_flops(1024, 5, torch.bfloat16) if cpu_bf16_native() else None
    torch.set_num_threads(before)
    return peak32, peak16


def run_size(name: str, args) -> list[str]:
    from rlpost.cluster import starter  # noqa: F401  (the loop's default placement)
    from rlpost.observe.recorder import Recorder
    from rlpost.pipeline import loop
    from rlpost.rewards.scorer import SampleWriter

    prof = Profile()
    out = tempfile.mkdtemp(prefix=f"rlpost-profile-{name}-")
    overrides = [f"model.tiny.{k}={v}" for k, v in SIZES[name].items()] + [
        "sft.steps=0",
        f"train.steps={args.steps}",
        "eval.limit=8",
        *QUIET_RUN,
        f"run.output_dir={out}",
        *args.overrides,
    ]
    cfg = load_config(str(Path(RECIPES_DIR) / "grpo_arith.yaml"), overrides)
    peak32, peak16 = peaks(cfg.run.threads)

    def start(*a, **kw):
        workers = loop.start_workers(*a, **kw)
        instrument(prof, workers)
        return workers

    real_step = loop.rl_step

    def rl_step(r, step):
        prof.step += 1
        prof.starts.append(time.perf_counter())
        return real_step(r, step)

    loop.rl_step = rl_step
    record, write = Recorder.record, SampleWriter.maybe_write
    Recorder.record = prof.timed(record, "logging")
    SampleWriter.maybe_write = prof.timed(write, "logging")
    try:
        loop.train(cfg, start=start)
    finally:
        loop.rl_step = real_step
        Recorder.record = record
        SampleWriter.maybe_write = write
    rows = []
    for k in range(2, len(prof.starts)):  # step k ran from starts[k-1] to starts[k]
        sec = dict(prof.seconds[k])
        total = prof.starts[k] - prof.starts[k - 1]
        sec["rollout other"] = sec.pop("rollout", 0.0) - sum(
            sec.get(p, 0.0) for p in ("rollout prefill", "rollout decode", "sampling")
        )
        sec["backward"] = sec.pop("update", 0.0) - sec.get("forward", 0.0) - sec.get("optimizer")
        sec["other"] = total - sum(sec.values())
        sec["total"] = total
        rows.append((sec, dict(prof.flops[k])))
    if not rows:
        raise SystemExit("too few steps to profile: use --steps >= 3")
    totals = [r[0]["total"] for r in rows]
    med = statistics.median(totals)
    lines = [
        f"\n{name}: {len(rows)} steps profiled, median step {med:.3f} s "
        f"(min {min(totals):.3f}, max {max(totals):.3f}), threads={torch.get_num_threads()}, "
        f"model.dtype={cfg.model.dtype}, matmul peak fp32 {peak32 / 1e9:.0f}"
        + (f" / bf16 {peak16 / 1e9:.0f}" if peak16 else "")
        + " GFLOP/s",
        "| phase | seconds | share | floor fp32 | floor bf16 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    fl_all = {p: statistics.median(r[1].get(p, 0.0) for r in rows) for p in PHASES}
    fl_all["backward"] = statistics.median(r[1].get("update", 0.0) for r in rows)
    floor_sum32 = floor_sum16 = 0.0
    for p in PHASES:
        s = statistics.median(r[0].get(p, 0.0) for r in rows)
        fl = fl_all.get(p, 0.0)
        f32 = f"{fl / peak32:.4f}" if fl else "-"
        f16 = f"{fl / peak16:.4f}" if fl and peak16 else "-"
        floor_sum32 += fl / peak32
        floor_sum16 += fl / peak16 if peak16 else 0.0
        lines.append(f"| {p} | {s:.4f} | {100 * s / med:.1f}% | {f32} | {f16} |")
    lines.append(
        f"| **step** | **{med:.4f}** | 100% | {floor_sum32:.4f} | "
        f"{f'{floor_sum16:.4f}' if peak16 else '-'} |"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="tiny,25M")
    ap.add_argument("--steps", type=int, default=8, help="RL steps per size (2 are left out)")
    ap.add_argument("--quick", action="store_true", help="4 steps per size")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every size")
    args = ap.parse_args()
    if args.quick:
        args.steps = 4
    print(describe_cpu())
    print(f"load before {os.getloadavg()[0]:.2f}")
    for name in args.sizes.split(","):
        print("\n".join(run_size(name, args)), flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
