"""Peak memory and step time at a real vocabulary: rlpost's full-logits path, its chunked
LM head, and TRL's GRPOTrainer, on one checkpoint in one run.

    python bench/bench_real_shape.py                          # 256 tokens: full, chunked, TRL
    python bench/bench_real_shape.py --lengths 128,256,512,1024 --sides chunked --plot curve.png
    python bench/bench_real_shape.py --lengths 256 --sides full,chunked --dtypes bf16 --steps 1

The checkpoint is an untrained Llama built from a config (no download): Qwen2.5's
vocabulary size of 151,936, hidden 256, 4 layers, tied embeddings. Its tokenizer
is the character tokenizer padded with filler tokens to that size, and its EOS
is one id past the model's vocabulary, so no sampled token ends a response: every
response is exactly ``--lengths`` tokens on both sides. GRPO 4 prompts x 8
samples (the default job's prompts), micro-batches of 8, one optimizer step per
batch, no KL, a reward that is the parity of the completion's length (so
advantages are not all zero and the backward does real work).

Sides: ``full`` is rlpost with ``train.logits_chunk_tokens=-1`` (the whole
``[B, T, V]`` logits at once, as before the chunked head), ``chunked`` is rlpost's
default, ``checkpointed`` the default with ``model.gradient_checkpointing=true``
(TRL's default), ``trl`` is TRL 1.16's GRPOTrainer (``pip install trl==1.16.0``;
``per_device_train_batch_size=8``, ``gradient_accumulation_steps=4``, its default
gradient checkpointing). Every run
is its own process, so its peak RSS (``ru_maxrss``) is its own; a run's step time
is the median of its steps after the first (the first when there is one). The
rows print each side against the ``full`` run (memory and time ratios) and
against TRL, each at the best of the dtypes run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_sizes import QUIET_RUN
from real_shape_report import report

VOCAB, PROMPTS, GROUP, MICRO, LR = 151_936, 4, 8, 8, 1e-5
SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
REWARD = "bench.bench_real_shape:parity_reward"
SIDES = {
    "full": ["train.logits_chunk_tokens=-1"],
    "chunked": [],
    "checkpointed": ["model.gradient_checkpointing=true"],  # as TRL's default
}
"""rlpost's sides: the overrides each adds to the shared settings."""


def parity_reward(sample, **_) -> float:
    """1.0 when the completion's text has an even length: a reward an untrained model gets
    half the time, so a GRPO group has a spread and its advantages are not zero."""
    return float(len(sample.completion) % 2 == 0)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------- checkpoint


def save_checkpoint(out: Path, max_positions: int) -> Path:
    """An untrained Llama of vocabulary :data:`VOCAB` and its padded character tokenizer."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    names = ["<pad>", "<s>", "<unk>", *chars]
    names += [f"<t{i}>" for i in range(VOCAB - len(names))]
    vocab = {tok: i for i, tok in enumerate(names)}
    vocab["</s>"] = VOCAB  # past the model's logits: never sampled
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=max_positions,
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        num_key_value_heads=SHAPE["num_attention_heads"],
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=VOCAB,
        pad_token_id=0,
        tie_word_embeddings=True,
        **SHAPE,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prompts_and_answers() -> tuple[list[str], list[str]]:
    from rlpost.config import load_config
    from rlpost.pipeline.build import build_data

    train, _, _ = build_data(load_config(None, []))
    return [p.text for p in train], [str(p.answer) for p in train]


# ------------------------------------------------------------------- workers


def run_rlpost(ckpt: str, dtype: str, length: int, steps: int, extra: list[str]) -> dict:
    """Seconds of each rlpost step and the peak RSS before the final evaluation."""
    import torch

    from rlpost.config import load_config
    from rlpost.pipeline import loop

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
            f"rollout.max_tokens={length}",
            "rollout.temperature=1.0",
            "rollout.truncated_reward=null",
            f"reward.terms=[{{name: '{REWARD}'}}]",
            f"train.mini_batch_size={PROMPTS * GROUP}",
            f"train.micro_batch_size={MICRO}",
            "algo.kl.beta=0.0",
            "eval.limit=1",
            *QUIET_RUN,
            f"run.output_dir={tempfile.mkdtemp(prefix='rlpost-real-')}",
            f"run.threads={torch.get_num_threads()}",
            *extra,
        ],
    )
    starts: list[float] = []
    real_step, real_eval = loop.rl_step, loop._full_eval
    seen: list[float] = []

    def rl_step(r, step):
        starts.append(time.perf_counter())
        return real_step(r, step)

    def full_eval(r, held_out):  # the training steps' peak, before the final evaluation
        seen.append(peak_rss_mib())
        return real_eval(r, held_out)

    loop.rl_step, loop._full_eval = rl_step, full_eval
    from rlpost.cluster import starter

    result = loop.train(cfg, start=starter(cfg))  # overlapped modes: separate processes
    last = result.history[-1]
    starts.append(starts[-1] + last["step_seconds"] + last.get("sync_seconds", 0.0))
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    estimate = summary.get("memory_estimate_mib", {}).get("total")
    return {
        "step_seconds": [b - a for a, b in itertools.pairwise(starts)],
        "peak_rss_mib": seen[-1] if seen else peak_rss_mib(),
        "run_dir": str(result.run_dir),
    } | ({"preflight_mib": estimate} if estimate else {})


MODE_KEYS = ("trainer_wait_seconds", "sample_lag", "rollout_utilization", "train_utilization")


def steady_steps(steps: list, mode: str) -> list:
    """The steps after the first, and in the overlapped modes before the last (fewer steps:
    what there is)."""
    inner = steps[1:-1] if mode != "sync" else steps[1:]
    return inner or steps[1:] or steps


def run_mode(ckpt: str, dtype: str, length: int, steps: int, mode: str) -> dict:
    """One ``pipeline.mode`` at the real shape: read back from its metrics.jsonl and
    summary.json. Its workers are separate processes in the overlapped modes, so the loop
    process's RSS is not the step's peak and is not reported."""
    import torch

    from rlpost.observe.recorder import read_metrics

    extra = [f"pipeline.mode={mode}"] + (["pipeline.max_staleness=2"] if mode == "async" else [])
    if mode != "sync":  # the trainer and the rollout process share the cores
        extra.append(f"run.threads={max(1, torch.get_num_threads() // 2)}")
    out = run_rlpost(ckpt, dtype, length, steps, extra)
    run_dir = Path(out.pop("run_dir"))
    rows = [r for r in read_metrics(run_dir) if "trainer_wait_seconds" in r or "step_seconds" in r]
    # The first step fills the pipeline; in the overlapped modes the last has no next batch
    # to generate beside it, so it is the trainer alone: neither is a steady step.
    steady = steady_steps(rows, mode)
    summary = json.loads((run_dir / "summary.json").read_text())
    out |= {k: statistics.median(r.get(k) or 0.0 for r in steady) for k in MODE_KEYS}
    out["completions_per_second"] = summary["completions_per_second"]
    out["steady_completions_per_second"] = (
        PROMPTS * GROUP / statistics.median(steady_steps(out["step_seconds"], mode))
    )
    out["steady_step_seconds"] = statistics.median(steady_steps(out["step_seconds"], mode))
    return out


def run_trl(ckpt: str, dtype: str, length: int, steps: int) -> dict:
    """Seconds of each TRL GRPOTrainer step at the same shape."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    texts, answers = prompts_and_answers()
    data = Dataset.from_dict({"prompt": texts, "answer": answers})

    def reward(completions, **_):
        return [float(len(c) % 2 == 0) for c in completions]

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter()) if not marks else None

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-real-"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
        num_generations=GROUP,
        max_completion_length=length,
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
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(ckpt),
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        "step_seconds": [b - a for a, b in itertools.pairwise(marks)],
        "peak_rss_mib": peak_rss_mib(),
    }


def worker(args) -> None:
    import torch

    from rlpost.observe.mfu import pick_threads

    torch.set_num_threads(pick_threads(args.threads))
    if args.worker == "trl":
        out = run_trl(args.ckpt, args.dtype, args.length, args.steps)
    elif args.worker.startswith("mode:"):
        out = run_mode(args.ckpt, args.dtype, args.length, args.steps, args.worker[5:])
    else:
        out = run_rlpost(args.ckpt, args.dtype, args.length, args.steps, SIDES[args.worker])
    out["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(out), flush=True)


# -------------------------------------------------------------------- parent


def rss_mib(pid: int) -> float:
    """The resident set of a live process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((x for x in f if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    except OSError:
        return 0.0
    return float(line.split()[1]) / 1024


def capped(cmd: list[str], env: dict, cap_mib: float) -> tuple[int, str, str | None]:
    """Run ``cmd``; kill it once its RSS passes ``cap_mib`` (exit code, output, why killed)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        why, top = None, 0.0
        while proc.poll() is None:
            top = max(top, rss_mib(proc.pid))
            if cap_mib and top > cap_mib:
                proc.kill()
                why = f"did not fit: its RSS passed the {cap_mib:,.0f} MiB cap"
            time.sleep(0.5)
        log.seek(0)
        return proc.wait(), log.read(), why


def one_run(side: str, dtype: str, length: int, ckpt: str, args) -> dict:
    """One measurement in its own process, so its peak RSS is its own; ``why`` when none."""
    cmd = [sys.executable, __file__, "--worker", side, "--dtype", dtype, "--ckpt", ckpt]
    cmd += ["--length", str(length), "--steps", str(args.steps), "--threads", str(args.threads)]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's rlpost, not an install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load = os.getloadavg()[0]
    tag = dict(side=side, dtype=dtype, length=length, load=load)
    free = available_mib()
    if args.cap_mib and free < args.cap_mib + 1024:  # the cap plus room for everything else
        out = tag | {"why": f"skipped: {free:,.0f} MiB available, under the cap + 1 GiB"}
    else:
        code, text, why = capped(cmd, env, args.cap_mib)
        line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
        if why or code != 0 or line is None:
            tail = " | ".join(text.strip().splitlines()[-2:])
            out = tag | {"why": why or f"failed (exit {code}): {tail}"}
        else:
            out = json.loads(line[len("RESULT ") :]) | tag
            timed = out["step_seconds"][1:] or out["step_seconds"]
            out["step"] = out.get("steady_step_seconds") or statistics.median(timed)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "runs.jsonl", "a") as f:
            f.write(json.dumps(out) + "\n")
    if "why" in out:
        print(f"  {side:>7} {dtype} {length:>5} tokens: {out['why']}", flush=True)
    else:
        print(
            f"  {side:>7} {dtype} {length:>5} tokens: peak RSS {out['peak_rss_mib']:7.0f} MiB  "
            f"step {out['step']:7.1f} s  threads {out['threads']}  load {load:.2f}"
            + (
                f"  preflight {out['preflight_mib']:,.0f} MiB "
                f"({out['preflight_mib'] / out['peak_rss_mib']:.2f}x the peak)"
                if out.get("preflight_mib")
                else ""
            ),
            flush=True,
        )
    return out


def available_mib() -> float:
    with open("/proc/meminfo") as f:
        line = next((x for x in f if x.startswith("MemAvailable:")), "MemAvailable: 0 kB")
    return float(line.split()[1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lengths", default="256", help="response lengths, e.g. 128,256,512,1024")
    ap.add_argument("--sides", default="full,chunked,trl", help="full, chunked, checkpointed, trl")
    ap.add_argument(
        "--dtypes", default="bf16", help="fp32, bf16 or fp32,bf16 (--modes run the first)"
    )
    ap.add_argument("--steps", type=int, default=2, help="steps per run (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: rlpost's rule)")
    ap.add_argument("--plot", default="", help="PNG path for peak memory against length")
    ap.add_argument("--modes", default="", help="pipeline modes, e.g. sync,one_step_off,async")
    ap.add_argument("--mode-length", type=int, default=256, help="response tokens of --modes")
    ap.add_argument("--mode-steps", type=int, default=3, help="steps per mode (first: fill)")
    ap.add_argument("--out", default="", help="directory for runs.jsonl (one line per run)")
    ap.add_argument(
        "--cap-mib", type=float, default=6144, help="kill a run whose RSS passes this (0: none)"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # trl, full, chunked or mode:NAME
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else []
    sides, dtypes = args.sides.split(","), args.dtypes.split(",")
    unknown = sorted(set(sides) - set(SIDES) - {"trl"})
    if unknown:
        ap.error(f"--sides: unknown {', '.join(unknown)} (full, chunked, checkpointed, trl)")
    modes = [m for m in args.modes.split(",") if m]
    longest = max(lengths + ([args.mode_length] if modes else []))
    ckpt = str(save_checkpoint(Path(tempfile.mkdtemp(prefix="real-ckpt-")), longest + 128))
    print(
        f"vocab {VOCAB:,}, {PROMPTS} prompts x {GROUP}, micro-batches of {MICRO}, "
        f"{args.steps} steps per run, RSS cap {args.cap_mib:,.0f} MiB; "
        f"load {os.getloadavg()[0]:.2f} (2 shared cores: step times are taken under load)",
        flush=True,
    )
    runs = {(s, d, n): one_run(s, d, n, ckpt, args) for n in lengths for d in dtypes for s in sides}
    steps = args.steps
    args.steps = args.mode_steps
    for m in modes:
        runs[(f"mode:{m}", dtypes[0], args.mode_length)] = one_run(
            f"mode:{m}", dtypes[0], args.mode_length, ckpt, args
        )
    args.steps = steps
    print("\n" + report(runs, args.plot))
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
