"""Packed against padded trainer passes at a real vocabulary and responses of mixed lengths.

    python bench/bench_packing.py                          # padded, packed: 3 steps each
    python bench/bench_packing.py --sides padded,packed,padded_budget,packed_budget --budget 2048

The checkpoint is bench_real_shape's untrained Llama (vocabulary 151,936, hidden 256,
4 layers, tied embeddings). The batch is GRPO's 4 prompts x 8: prompts of 12-28 tokens,
responses drawn uniformly from ``--min-len``..``--max-len`` tokens (a fixed seed, the same
rows for every side), micro-batches of 8 rows, one optimizer step per batch. A step is
what the trainer does with a rollout batch: the old-logprob pass and the update (its loss
pass, backward and AdamW step). Sides: ``padded`` (``train.packing=off``), ``packed``
(``on``), and ``*_budget``, the same with ``train.max_tokens_per_micro_batch=--budget``
(rows longest first; padded counts rows x widest, packed counts real tokens). Each side is
its own process, so its peak RSS (``ru_maxrss``) is its own; its step time (wall and CPU,
the CPU time being the steadier on a shared machine) is the median of its steps after the
first (the first when there is one). The last lines print each side against ``padded``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_real_shape import GROUP, MICRO, PROMPTS, save_checkpoint

SIDES = {
    "padded": ("off", False),
    "packed": ("on", False),
    "padded_budget": ("off", True),
    "packed_budget": ("on", True),
}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make_batch(vocab: int, min_len: int, max_len: int):
    import torch

    from rlpost.algos import get_advantage_estimator, scores_to_token_rewards
    from rlpost.train.batch import collate
    from rlpost.types import Completion

    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(PROMPTS * GROUP):
        p = 12 + int(torch.randint(0, 17, (1,), generator=gen))
        r = min_len + int(torch.randint(0, max_len - min_len + 1, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (p,), generator=gen).tolist()
        response = torch.randint(3, vocab, (r,), generator=gen).tolist()
        rows.append(Completion(prompt, response, [-1.0] * r, "stop", 0, i // GROUP))
    b = collate(rows, [float(i % 2) for i in range(len(rows))], 0)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlpost.config import OptimConfig
    from rlpost.params import PPOClipParams
    from rlpost.train.actor import ActorSettings, PolicyTrainer

    torch.set_num_threads(args.threads)
    packing, budgeted = SIDES[args.worker]
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32)
    settings = ActorSettings(
        optim=OptimConfig(lr=1e-5),
        mini_batch_size=PROMPTS * GROUP,
        micro_batch_size=MICRO,
        max_tokens_per_micro_batch=args.budget if budgeted else 0,
        packing=packing,
        bf16=args.dtype == "bf16",
    )
    trainer = PolicyTrainer(model, PPOClipParams(), settings)
    assert trainer.packed == (packing == "on"), "this model should pack"
    batch = make_batch(model.config.vocab_size, args.min_len, args.max_len)
    seconds, cpu, losses = [], [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        batch.old_logprobs = trainer.old_logprobs(batch)
        losses.append(trainer.update(batch).stats["loss"])
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out = {"step_seconds": seconds, "cpu_seconds": cpu, "peak_rss_mib": peak_rss_mib()}
    out["loss"] = losses[0]
    print("RESULT " + json.dumps(out), flush=True)


def one_run(side: str, ckpt: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", side, "--ckpt", ckpt]
    for key in ("steps", "threads", "budget", "min_len", "max_len", "dtype"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's rlpost, not an install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        print(f"  {side}: failed (exit {proc.returncode}): {tail}", flush=True)
        return None
    out = json.loads(line[len("RESULT ") :])
    out["step"] = statistics.median(out["step_seconds"][1:] or out["step_seconds"])
    out["cpu"] = statistics.median(out["cpu_seconds"][1:] or out["cpu_seconds"])
    print(
        f"  {side:>13}: peak RSS {out['peak_rss_mib']:7.0f} MiB  step {out['step']:6.1f} s  "
        f"(CPU {out['cpu']:6.1f} s)  "
        f"first loss {out['loss']:+.6f}  load {load:.2f}",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sides", default="padded,packed", help=", ".join(SIDES))
    ap.add_argument("--steps", type=int, default=3, help="steps per side (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch (*_budget)")
    ap.add_argument("--min-len", type=int, default=32, help="shortest response")
    ap.add_argument("--max-len", type=int, default=256, help="longest response")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sides = args.sides.split(",")
    ckpt = str(save_checkpoint(Path(tempfile.mkdtemp(prefix="pack-ckpt-")), args.max_len + 64))
    print(
        f"{PROMPTS} x {GROUP} rows, responses {args.min_len}-{args.max_len} tokens, "
        f"micro-batches of {MICRO}, {args.dtype}, {args.threads} thread(s), {args.steps} steps",
        flush=True,
    )
    runs = {s: one_run(s, ckpt, args) for s in sides}
    base = runs.get("padded")
    for s, r in runs.items():
        if r and base and s != "padded":
            print(
                f"{s} / padded: peak RSS {r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x, "
                f"speed {base['step'] / r['step']:.2f}x (CPU time {base['cpu'] / r['cpu']:.2f}x)"
            )


if __name__ == "__main__":
    main()
