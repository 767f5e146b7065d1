"""Rollout tokens/s of ``vllm`` (in process) against ``hf_continuous`` and ``hf``, one run.

The same prompts (arithmetic questions in the model's chat template, as
``grpo_smollm2`` samples them), group size, sampling (T=1, no truncation),
dtype and thread count for every engine; rounds alternate the engines' order so
machine noise hits them alike, and the median of each is printed with the
ratio of vllm to each other engine. vLLM runs eager (no compilation) with its
CPU threads bound to the first ``--threads`` cores. Each engine lives in its own
worker process: vLLM in vLLM's environment (its CPU build pins an older
transformers: deploy/vllm_env.sh), the hf engines in rlpost's:

    PYTHONPATH=$PWD python bench/bench_vllm_rollout.py \\
        --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        --vllm-python /work/venvs/vllm/bin/python [--prompts 8] [--group 4] \\
        [--max-tokens 32] [--repeats 3] [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the rlpost CLI runs
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from rlpost.data import arith_splits
from rlpost.rollout.engines.continuous import ContinuousEngine
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.prefix_cache import PrefixCache
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.scheduler import Scheduler


def build_engine(name: str, args, tok):
    from transformers import AutoModelForCausalLM

    rows = args.prompts * args.group
    if name == "vllm":
        from rlpost.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(
            args.model, tok, dtype=args.dtype, max_model_len=1024, max_num_seqs=rows,
            extra={"enforce_eager": True},
        )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval().requires_grad_(False)
    if name == "hf":
        return HFEngine(model, tok, batch_size=rows, seed=0)
    scheduler = Scheduler(model, tok, max_batch=rows, prefix_cache=PrefixCache(), seed=0)
    return ContinuousEngine(scheduler.start(), tok)


def prompts(tok, count: int) -> list[list[int]]:
    train, _ = arith_splits(20, ["+", "-"], 1000, 10)
    out = []
    for p in train[:count]:
        chat = [{"role": "user", "content": f"Compute {p.text} Reply with the number only."}]
        out.append(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    return [tok(t, add_special_tokens=False)["input_ids"] for t in out]


def rate(engine, ids, args, eos: int) -> float:
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=(eos,))
    start = time.perf_counter()
    out = engine.generate(ids, params, n=args.group)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)


def worker(args) -> None:
    """One engine in this process: a rate per ``go`` line on stdin, until stdin closes."""
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    engine = build_engine(args.worker, args, tok)
    ids = prompts(tok, args.prompts)
    rate(engine, ids[:2], argparse.Namespace(**{**vars(args), "max_tokens": 4}), tok.eos_token_id)
    print("ready", flush=True)
    for _ in sys.stdin:
        print(f"rate {rate(engine, ids, args, tok.eos_token_id)}", flush=True)
    if hasattr(engine, "close"):
        engine.close()


def start_worker(name: str, python: str, argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}
    cmd = [python, __file__, *argv, "--worker", name]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"the {name} worker exited {proc.wait()} before it was ready")


def ask(proc: subprocess.Popen) -> float:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("rate "):
            return float(line.split()[1])
    raise RuntimeError("a worker exited mid-round")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local HF checkpoint directory")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vllm-python", default=sys.executable, help="python of the vLLM env")
    ap.add_argument("--hf-python", default=sys.executable, help="python of rlpost's env")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    if args.worker:
        return worker(args)
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in COMMON]
    pythons = {"vllm": args.vllm_python, "hf_continuous": args.hf_python, "hf": args.hf_python}
    procs = {name: start_worker(name, py, common) for name, py in pythons.items()}
    rates: dict[str, list[float]] = {name: [] for name in procs}
    try:
        for r in range(args.repeats):  # alternate so machine noise hits every engine alike
            for name in list(procs) if r % 2 == 0 else list(procs)[::-1]:
                rates[name].append(ask(procs[name]))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(
        f"SmolLM2 rollout, {args.prompts} prompts x G={args.group}, max_tokens={args.max_tokens}, "
        f"{args.dtype}, threads={args.threads}, {args.repeats} rounds, load {os.getloadavg()[0]:.2f}"
    )
    for name, v in rates.items():
        line = (
            f"  {name:14s} {med[name]:8.1f} tokens/s  (rounds: {', '.join(f'{x:.1f}' for x in v)})"
        )
        if name != "vllm":
            line += f"  vllm/{name} = {med['vllm'] / med[name]:.2f}x"
        print(line)


COMMON = ("model", "prompts", "group", "max_tokens", "threads", "dtype")


if __name__ == "__main__":
    main()
