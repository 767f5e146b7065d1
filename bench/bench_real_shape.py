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
default, ``trl`` is TRL 1.16's GRPOTrainer (``pip install trl==1.16.0``;
``per_device_train_batch_size=8``, ``gradient_accumulation_steps=4``). Every run
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

VOCAB, PROMPTS, GROUP, MICRO, LR = 151_936, 4, 8, 8, 1e-5
SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
REWARD = "bench.bench_real_shape:parity_reward"


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
            f"train.lr={LR}",
            "train.warmup_steps=0",
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
    result = loop.train(cfg)
    last = result.history[-1]
    starts.append(starts[-1] + last["step_seconds"] + last.get("sync_seconds", 0.0))
    return {
        "step_seconds": [b - a for a, b in itertools.pairwise(starts)],
        "peak_rss_mib": seen[-1] if seen else peak_rss_mib(),
    }


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
    else:
        extra = ["train.logits_chunk_tokens=-1"] if args.worker == "full" else []
        out = run_rlpost(args.ckpt, args.dtype, args.length, args.steps, extra)
    out["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(out), flush=True)


# -------------------------------------------------------------------- parent


def one_run(side: str, dtype: str, length: int, ckpt: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", side, "--dtype", dtype, "--ckpt", ckpt]
    cmd += ["--length", str(length), "--steps", str(args.steps), "--threads", str(args.threads)]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's rlpost, not an install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        print(f"  {side} {dtype} {length}: failed (exit {proc.returncode}): {tail}", flush=True)
        return None
    out = json.loads(line[len("RESULT ") :])
    timed = out["step_seconds"][1:] or out["step_seconds"]
    out["step"] = statistics.median(timed)
    print(
        f"  {side:>7} {dtype} {length:>5} tokens: peak RSS {out['peak_rss_mib']:7.0f} MiB  "
        f"step {out['step']:7.1f} s  threads {out['threads']}  load {load:.2f}",
        flush=True,
    )
    return out


def best(runs: dict, side: str, length: int, key: str) -> float | None:
    """The side's best (lowest) value of ``key`` over the dtypes run at ``length``."""
    vals = [r[key] for (s, _, n), r in runs.items() if s == side and n == length and r]
    return min(vals) if vals else None


def table(runs: dict, lengths: list[int], sides: list[str]) -> str:
    head = "| tokens | " + " | ".join(f"{s} peak MiB / step s" for s in sides)
    ratios = [(a, b) for a, b in (("chunked", "full"), ("chunked", "trl")) if {a, b} <= set(sides)]
    head += "".join(f" | {a} / {b} memory, speed" for a, b in ratios) + " |"
    lines = [head, "|" + " --- |" * (1 + len(sides) + len(ratios))]
    for n in lengths:
        cells = []
        for s in sides:
            m, t = best(runs, s, n, "peak_rss_mib"), best(runs, s, n, "step")
            cells.append("failed" if m is None else f"{m:.0f} / {t:.1f}")
        for a, b in ratios:
            ma, mb = best(runs, a, n, "peak_rss_mib"), best(runs, b, n, "peak_rss_mib")
            ta, tb = best(runs, a, n, "step"), best(runs, b, n, "step")
            ok = None not in (ma, mb, ta, tb)
            cells.append(f"**{ma / mb:.2f}x**, **{tb / ta:.2f}x**" if ok else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict, lengths: list[int], sides: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in sides:
        pts = [(n, best(runs, s, n, "peak_rss_mib")) for n in lengths]
        pts = [(n, m) for n, m in pts if m is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=s)
    ax.set_xlabel("response tokens")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title(f"vocab {VOCAB:,}, hidden 256, 4 layers; {PROMPTS} x {GROUP}, micro {MICRO}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lengths", default="256", help="response lengths, e.g. 128,256,512,1024")
    ap.add_argument("--sides", default="full,chunked,trl", help="full, chunked, trl")
    ap.add_argument("--dtypes", default="bf16", help="fp32, bf16 or both")
    ap.add_argument("--steps", type=int, default=2, help="steps per run (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: rlpost's rule)")
    ap.add_argument("--plot", default="", help="PNG path for peak memory against length")
    ap.add_argument("--worker", choices=["trl", "full", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    sides, dtypes = args.sides.split(","), args.dtypes.split(",")
    ckpt = str(save_checkpoint(Path(tempfile.mkdtemp(prefix="real-ckpt-")), max(lengths) + 128))
    print(
        f"vocab {VOCAB:,}, {PROMPTS} prompts x {GROUP}, micro-batches of {MICRO}, "
        f"{args.steps} steps per run; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    runs = {(s, d, n): one_run(s, d, n, ckpt, args) for n in lengths for d in dtypes for s in sides}
    print("\n" + table(runs, lengths, sides))
    if args.plot:
        plot(runs, lengths, sides, args.plot)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
