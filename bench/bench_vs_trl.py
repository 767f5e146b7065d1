"""rlpost against TRL's GRPOTrainer on the same checkpoint, prompts and settings, in one run.

    pip install -e '.[bench]'                 # TRL 1.16 (a bench dependency only)
    python bench/bench_vs_trl.py              # tiny and ~25M, 3 rounds
    python bench/bench_vs_trl.py --quick      # tiny and ~25M, 1 round, fewer steps

Both sides train one local Llama checkpoint (built from a config, saved to a
temporary directory) on the same arithmetic prompts (the default job's data):
16 prompts x 8 samples, responses up to 8 tokens, one optimizer step per batch,
no KL (so neither keeps a reference model), temperature 1, the same LR, all
128 rows generated in one batch (TRL's generation batch; rlpost's
``rollout.batch_size``, 64 by default, as the default job's recipe sets 512). Each
side runs in fp32 and in bf16 compute (rlpost: ``model.dtype=bfloat16``; TRL:
``bf16=True``), each configuration in its own subprocess (so peak RSS is its
own; rlpost's is read after its last step, before the final evaluation and
checkpoint, since TRL here saves none), alternating sides and dtypes over
several rounds. A run's rate is 128
completions over the median step time (the first step, warm-up, left out);
each side's rate is the median over rounds of its better dtype, and the ratio
is rlpost over TRL, best against best. Both sides get the same torch thread
count (``--threads``; 0: rlpost's ``run.threads=0`` rule, the free cores at
start) and the same ``OMP_WAIT_POLICY`` (PASSIVE unless set, as the rlpost CLI
runs). The 1-minute load average is printed with each run: other processes on
the machine move both sides.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_sizes import QUIET_RUN, SIZES

PROMPTS, GROUP, MAX_TOKENS, LR = 16, 8, 8, 1e-5
PEAK: dict[str, float] = {}  # a worker's peak RSS when it is not the process's own


def prompts_and_answers() -> tuple[list[str], list[str]]:
    """The default job's training prompts, rendered as rlpost renders them."""
    from rlpost.config import load_config
    from rlpost.pipeline.build import build_data

    train, _, _ = build_data(load_config(None, []))
    return [p.text for p in train], [str(p.answer) for p in train]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------- workers


def run_trl(ckpt: str, dtype: str, steps: int) -> list[float]:
    """Seconds of each TRL GRPOTrainer step (generation, scoring, update)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    texts, answers = prompts_and_answers()
    data = Dataset.from_dict({"prompt": texts, "answer": answers})

    def reward(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter()) if not marks else None

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    out = tempfile.mkdtemp(prefix="trl-bench-")
    config = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        temperature=1.0,
        learning_rate=LR,
        max_steps=steps,
        bf16=dtype == "bf16",
        use_cpu=True,
        logging_steps=10_000,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    return [b - a for a, b in itertools.pairwise(marks)]


def run_rlpost(ckpt: str, dtype: str, steps: int, extra: list[str] = ()) -> list[float]:
    """Seconds of each rlpost step (rollout, reward, update, weight sync)."""
    import torch

    from rlpost.config import load_config
    from rlpost.pipeline import loop

    out = tempfile.mkdtemp(prefix="rlpost-bench-")
    cfg = load_config(
        None,
        [
            f"model.path={ckpt}",
            f"model.dtype={'bfloat16' if dtype == 'bf16' else 'float32'}",
            "sft.steps=0",
            f"train.steps={steps}",
            f"train.optim.lr={LR}",
            "train.optim.warmup_steps=0",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.n={GROUP}",
            f"rollout.max_tokens={MAX_TOKENS}",
            f"rollout.batch_size={PROMPTS * GROUP}",  # TRL generates the whole batch at once
            "rollout.temperature=1.0",
            f"train.mini_batch_size={PROMPTS * GROUP}",
            f"train.micro_batch_size={PROMPTS * GROUP}",
            "algo.kl.beta=0.0",
            "eval.limit=1",
            *QUIET_RUN,
            f"run.output_dir={out}",
            f"run.threads={torch.get_num_threads()}",  # the worker's choice, as TRL's
            *extra,
        ],
    )
    starts: list[float] = []
    real = loop.rl_step

    def rl_step(r, step):
        starts.append(time.perf_counter())
        return real(r, step)

    loop.rl_step = rl_step
    # Peak RSS of the training steps: read before the final evaluation and checkpoint
    # (TRL's run here saves none), which serialise the weights and optimizer state.
    evals, real_eval = [], loop._full_eval

    def full_eval(r, held_out):
        evals.append(peak_rss_mib())
        return real_eval(r, held_out)

    loop._full_eval = full_eval
    result = loop.train(cfg)
    PEAK["rss"] = evals[-1]
    # The last step ends where the loop's last record does: its own step_seconds plus sync.
    last = result.history[-1]
    starts.append(starts[-1] + last["step_seconds"] + last.get("sync_seconds", 0.0))
    return [b - a for a, b in itertools.pairwise(starts)]


def worker(args) -> None:
    import torch

    from rlpost.observe.mfu import pick_threads

    torch.set_num_threads(pick_threads(args.threads))  # the same rule for both sides
    if args.worker == "trl":
        seconds = run_trl(args.ckpt, args.dtype, args.steps)
    else:
        seconds = run_rlpost(args.ckpt, args.dtype, args.steps, args.rlpost_set)
    print(
        "RESULT "
        + json.dumps(
            {
                "step_seconds": seconds,
                "peak_rss_mib": PEAK.get("rss", peak_rss_mib()),
                "threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )


# -------------------------------------------------------------------- parent


def one_run(side: str, dtype: str, ckpt: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--dtype", dtype, "--ckpt", ckpt]
    cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
    cmd += [f"--rlpost-set={kv}" for kv in args.rlpost_set] if side == "rlpost" else []
    root = str(Path(__file__).resolve().parents[1])  # this checkout's rlpost, not an install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the rlpost CLI runs; the same for both
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"{side} {dtype} failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(line[len("RESULT ") :])
    timed = out["step_seconds"][1:] or out["step_seconds"]  # the first step is warm-up
    out["rate"] = PROMPTS * GROUP / statistics.median(timed)
    return out


def compare(name: str, args) -> str:
    from rlpost.models.tiny import save_tiny_checkpoint

    ckpt = str(
        save_tiny_checkpoint(
            tempfile.mkdtemp(prefix=f"bench-ckpt-{name}-"),
            max_position_embeddings=128,
            **SIZES[name],
        )
    )
    rates: dict[tuple[str, str], list[float]] = {}
    rss: dict[str, float] = {}
    for r in range(args.rounds):
        order = [(side, d) for d in args.dtypes.split(",") for side in ("trl", "rlpost")]
        if r % 2:
            order = order[::-1]  # alternate who goes first, so a trend in load hits both
        for side, dtype in order:
            load = os.getloadavg()[0]
            out = one_run(side, dtype, ckpt, args)
            rates.setdefault((side, dtype), []).append(out["rate"])
            rss[side] = max(rss.get(side, 0.0), out["peak_rss_mib"])
            print(
                f"  {name} round {r + 1} {side:>6} {dtype}: {out['rate']:8.1f} completions/s  "
                f"peak RSS {out['peak_rss_mib']:7.0f} MiB  threads {out['threads']}  load {load:.2f}",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in rates.items()}
    dtypes = args.dtypes.split(",")
    best = {s: max(med[(s, d)] for d in dtypes) for s in ("trl", "rlpost")}

    def rates_of(side: str) -> str:
        return " / ".join(f"{med[(side, d)]:.1f}" for d in dtypes)

    return (
        f"| {name} | {rates_of('trl')} | {rates_of('rlpost')} | "
        f"**{best['rlpost'] / best['trl']:.2f}x** | {rss['trl']:.0f} / {rss['rlpost']:.0f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="tiny,25M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads, both sides (0: rlpost's rule)"
    )
    ap.add_argument("--quick", action="store_true", help="1 round of 4 steps per run")
    ap.add_argument(
        "--dtypes", default="fp32,bf16", help="fp32, bf16 or both (best of them per side)"
    )
    ap.add_argument(
        "--rlpost-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra rlpost config override (repeatable), e.g. run.malloc_mmap_threshold=131072",
    )
    ap.add_argument("--worker", choices=["trl", "rlpost"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rounds, args.steps = 1, 4
    print(
        f"{PROMPTS} prompts x {GROUP} samples, <= {MAX_TOKENS} tokens, 1 optimizer step per batch, "
        f"no KL; {args.rounds} rounds x {args.steps} steps; load {os.getloadavg()[0]:.2f}"
    )
    rows = [compare(name, args) for name in args.sizes.split(",")]
    print(
        f"\n| model | TRL {args.dtypes.replace(',', ' / ')} completions/s | rlpost "
        f"{args.dtypes.replace(',', ' / ')} | rlpost / TRL, best "
        "against best | peak RSS MiB, TRL / rlpost |\n| --- | --- | --- | --- | --- |"
    )
    print("\n".join(rows))
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
