"""Rollout and GRPO-step throughput, against baselines measured in the same run.

1. Rollout tokens/s: rlpost's HFEngine (prompt prefilled once per group, KV
   repeated, finished rows dropped) against plain
   ``model.generate(..., num_return_sequences=G, do_sample=True)`` on the same
   prompts and settings. Target: >= 2x at G = 8.
2. End-to-end completions/s of one GRPO step (rollout, reward, old/ref logprobs,
   advantages, update) with the same engine.

Both at two model sizes of the same (Llama) family: the tiny default (overhead
bound) and a ~25M-parameter model (compute bound), and each contender in fp32
and, where the CPU has native bf16 instructions (detected), in bf16 (the
serving copy ``model.dtype=bfloat16`` uses); the ratio is printed per dtype,
best against best, and against ``generate()`` on the model as loaded (fp32).

    python bench/bench_rollout.py [--prompts 32] [--group 8] [--max-tokens 16] [--repeats 3]
    python bench/bench_rollout.py --fewshot 12 --eos-bias 4 --max-tokens 64 --no-grpo
    python bench/bench_rollout.py --quick     # rollout only, 2 repeats (a few minutes)

The first form is the worst case for the engine (6-token prompts, no sequence
stops early): prefill sharing and row dropping have nothing to save. The second
is closer to RL practice: a long shared prompt (few-shot context) and responses
whose lengths spread out, so some finish early.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

# Both contenders wait passively, as the rlpost CLI runs (set before torch loads OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from model_sizes import SIZES

from rlpost.config import load_config
from rlpost.data import arith_splits
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.observe.mfu import cpu_bf16_native, pick_threads
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos: int, pad: int) -> int:
    """Tokens generate() actually produced: up to and including the first EOS of each row."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        n = 0
        for tok in row:
            n += 1
            if tok in (eos, pad):
                break
        total += n
    return total


def bench_generate(model, tok, prompts, group, max_tokens) -> tuple[float, int]:
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            num_return_sequences=group,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    seconds = time.perf_counter() - start
    return seconds, generated_tokens(
        out, enc["input_ids"].shape[1], tok.eos_token_id, tok.pad_token_id
    )


def bench_engine(engine, tok, prompts, group, max_tokens) -> tuple[float, int]:
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    start = time.perf_counter()
    out = engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=max_tokens), n=group)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in out)


def rollout_ratio(name: str, shape: dict, args) -> None:
    tok = build_char_tokenizer()
    base = build_tiny_model(tok, max_position_embeddings=512, **shape).eval()
    models = {"fp32": base}
    if "bf16" in args.dtypes:
        models["bf16"] = copy.deepcopy(base).to(torch.bfloat16)  # as model.dtype=bfloat16 serves
    if args.eos_bias:
        # A random model almost never stops; a bias on EOS gives the spread of
        # lengths a trained policy has (most answers short, a long tail).
        bias = torch.zeros(len(tok))
        bias[tok.eos_token_id] = args.eos_bias
        for model in models.values():
            model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    train, _ = arith_splits(50, ["+", "-"], 10_000, 100)
    shots = "".join(f"{p.text}{p.answer}\n" for p in train[-args.fewshot :]) if args.fewshot else ""
    prompts = [shots + p.text for p in train[: args.prompts]]
    engines = {
        d: HFEngine(m, tok, batch_size=args.prompts * args.group, seed=0) for d, m in models.items()
    }
    for d in models:  # warm-up
        bench_engine(engines[d], tok, prompts[:2], args.group, 2)
        bench_generate(models[d], tok, prompts[:2], args.group, 2)
    eng: dict[str, list[float]] = {d: [] for d in models}
    gen: dict[str, list[float]] = {d: [] for d in models}
    for r in range(args.repeats):  # alternate so machine noise hits both alike
        for d in models if r % 2 == 0 else list(models)[::-1]:
            s, n = bench_engine(engines[d], tok, prompts, args.group, args.max_tokens)
            eng[d].append(n / s)
            s, n = bench_generate(models[d], tok, prompts, args.group, args.max_tokens)
            gen[d].append(n / s)
    params = sum(p.numel() for p in base.parameters()) / 1e6
    e = {d: statistics.median(v) for d, v in eng.items()}
    g = {d: statistics.median(v) for d, v in gen.items()}
    per = "   ".join(
        f"{d}: engine {e[d]:8.0f} generate() {g[d]:8.0f} ({e[d] / g[d]:4.2f}x)" for d in models
    )
    best_e, best_g = max(e.values()), max(g.values())
    print(
        f"{name:>5} ({params:5.1f}M)  {per}   best against best {best_e / best_g:4.2f}x   "
        f"against generate() fp32 {best_e / g['fp32']:4.2f}x   load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def grpo_step_rate(name: str, shape: dict, args) -> None:
    from rlpost.pipeline.loop import train

    overrides = [f"model.tiny.{k}={v}" for k, v in shape.items()] + [
        "model.tiny.max_position_embeddings=256",
        "sft.steps=0",
        f"train.steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.group}",
        f"rollout.max_tokens={args.max_tokens}",
        f"train.mini_batch_size={args.prompts * args.group}",
        f"train.micro_batch_size={min(64, args.prompts * args.group)}",
        "eval.limit=8",
        "eval.every=0",
        "checkpoint.every=0",
        "observe.progress=false",
        "observe.plot=false",
        f"run.output_dir=/tmp/rlpost_bench_{name}",
        "reward.sample_every=0",
    ]
    result = train(load_config(None, overrides))
    seconds = [h["step_seconds"] for h in result.history[1:]]  # first step pays for warm-up
    per_step = args.prompts * args.group
    print(
        f"{name:>5}  GRPO step: {per_step / statistics.median(seconds):8.1f} completions/s "
        f"({statistics.median(seconds):.3f} s/step, {per_step} completions)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sizes", default="tiny,25M")
    ap.add_argument(
        "--fewshot", type=int, default=0, help="worked examples before each prompt (longer prompts)"
    )
    ap.add_argument(
        "--eos-bias", type=float, default=0.0, help="logit bias on EOS (spread of lengths)"
    )
    ap.add_argument("--no-grpo", action="store_true", help="only the rollout comparison")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="fp32,bf16 (default: bf16 too where the CPU has native bf16 instructions)",
    )
    ap.add_argument("--quick", action="store_true", help="2 repeats, rollout comparison only")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: rlpost's rule)")
    args = ap.parse_args()
    torch.set_num_threads(pick_threads(args.threads))
    if args.dtypes is None:
        args.dtypes = "fp32,bf16" if cpu_bf16_native() else "fp32"
    if args.quick:
        args.repeats, args.no_grpo = 2, True
    torch.manual_seed(0)
    print(
        f"rollout: {args.prompts} prompts x G={args.group}, max_tokens={args.max_tokens}, "
        f"fewshot={args.fewshot}, eos_bias={args.eos_bias}, threads={torch.get_num_threads()}, "
        f"dtypes {args.dtypes}, load {os.getloadavg()[0]:.2f}"
    )
    for name in args.sizes.split(","):
        rollout_ratio(name, SIZES[name], args)
    if args.no_grpo:
        return
    for name in args.sizes.split(","):
        grpo_step_rate(name, SIZES[name], args)


if __name__ == "__main__":
    main()
