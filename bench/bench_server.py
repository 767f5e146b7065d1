"""Rollout throughput: in-process engines against rollout servers, and partial rollout.

Part 1, tokens/s on one workload (``--prompts`` prompts, ``n`` samples each,
exactly ``--max-tokens`` tokens per sample: EOS is masked so every side does
the same work), sides measured in alternating rounds and reported as medians:

* ``hf_engine``: the in-process engine (one batched ``generate``), the baseline;
* ``scheduler``: the continuous-batching scheduler in process (no HTTP);
* ``hf_generate_batch``: transformers' own continuous batching, for reference;
* ``server x1``: one ``rlpost serve`` process, prompts sent concurrently by
  :class:`RemoteEngine` (one request per prompt with n samples);
* ``server x2``: two servers behind the load balancer.

Every process uses ``--threads`` torch threads (default 1: oversubscribing
the cores with server and client threads collapses throughput). On a machine
with few cores two servers compete with each other and with the client, so
they show the cost of HTTP and contention rather than a speed-up; on two
machines they would add up.

Part 2, partial rollout on a long-tailed batch: EOS gets a logit bias so
response lengths are geometric (median ~11 tokens; a step of 128 samples
waits for one of ~80). Steps of ``--prompts`` prompts run on the in-process
scheduler (:class:`ContinuousEngine`) through one synchronous ``generate``
per step, and through :class:`PartialRollout` at fraction 1.0 and 0.8 (the
step stops once done; the tail is aborted and continued in the next step);
printed are seconds per step and trained samples per second.

    python bench/bench_server.py [--prompts 32] [--n 4] [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from rlpost.models.loading import load_causal_lm, load_tokenizer
from rlpost.models.tiny import save_tiny_checkpoint
from rlpost.rollout.engines.continuous import ContinuousEngine
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.rollout.engines.scheduler import GenerationRequest, Scheduler
from rlpost.rollout.longtail import PartialRollout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' shared helpers
import serve_util


class LogitBias(torch.nn.Module):
    """Wraps a causal LM and adds ``bias`` to one token's logit (EOS masking or boosting)."""

    def __init__(self, model: torch.nn.Module, token: int, bias: float) -> None:
        super().__init__()
        self.model, self.token, self.bias = model, token, bias
        self.config = model.config

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        out.logits[..., self.token] += self.bias
        return out


def start_server(model_dir: Path, threads: int) -> tuple[subprocess.Popen, str]:
    flags = ["--threads", str(threads), "--max-batch", "256", "--max-n", "64"]
    return serve_util.start_server(model_dir, *flags)


def tokens_per_second(run, expected_tokens: int) -> float:
    start = time.perf_counter()
    produced = run()
    elapsed = time.perf_counter() - start
    if produced != expected_tokens:
        raise SystemExit(f"a side produced {produced} tokens, expected {expected_tokens}")
    return produced / elapsed


def throughput_sides(model_dir: Path, args, servers: dict[str, list[str]]) -> dict:
    """Median tokens/s of each side; every side decodes exactly the same number of tokens."""
    model, tok = load_causal_lm(model_dir).eval(), load_tokenizer(model_dir)
    no_eos = LogitBias(model, tok.eos_token_id, float("-inf"))  # fixed lengths in process
    prompts = [
        tok(f"{i}+{2 * i}=", add_special_tokens=False)["input_ids"] for i in range(args.prompts)
    ]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    hf = HFEngine(no_eos, tok, batch_size=args.prompts * args.n)
    sched = Scheduler(no_eos, tok, max_batch=args.prompts * args.n).start()
    remotes = {
        name: RemoteEngine(
            urls, tok, max_inflight_per_server=args.prompts, extra_body={"ignore_eos": True}
        )
        for name, urls in servers.items()
    }

    def run_sched():
        tickets = [sched.submit(GenerationRequest(p, params, n=args.n)) for p in prompts]
        return sum(len(o.token_ids) for t in tickets for o in t.future.result())

    def run_cb():
        gen = GenerationConfig(
            max_new_tokens=args.max_tokens, do_sample=True, num_return_sequences=args.n,
            eos_token_id=-1, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        cb = ContinuousBatchingConfig(num_blocks=256, page_size=32, return_logprobs=True)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        return sum(len(o.generated_tokens) for o in out.values())

    def engine_side(engine):
        return lambda: sum(len(c.token_ids) for c in engine.generate(prompts, params, n=args.n))

    sides = {"hf_engine": engine_side(hf), "scheduler": run_sched, "hf_generate_batch": run_cb}
    sides.update({name: engine_side(engine) for name, engine in remotes.items()})
    expected = args.prompts * args.n * args.max_tokens
    results: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            results[name].append(tokens_per_second(run, expected))
    sched.stop()
    for engine in remotes.values():
        engine.close()
    return {name: statistics.median(v) for name, v in results.items()}


def partial_rollout_side(model_dir: Path, args) -> dict:
    """Seconds per step and trained samples/s: one synchronous generate vs partial rollout."""
    model, tok = load_causal_lm(model_dir).eval(), load_tokenizer(model_dir)
    # p(EOS) ~ 0.06 per token on the untrained tiny model: geometric, long-tailed lengths.
    biased = LogitBias(model, tok.eos_token_id, 1.85)
    params = SamplingParams(temperature=1.0, max_tokens=100, stop_token_ids=(tok.eos_token_id,))
    prompts = [tok(f"{i}*{i}=", add_special_tokens=False)["input_ids"] for i in range(args.prompts)]
    out = {}
    for label, fraction in (("sync generate", None), ("partial 1.0", 1.0), ("partial 0.8", 0.8)):
        scheduler = Scheduler(biased, tok, max_batch=4096, seed=0).start()
        engine = ContinuousEngine(scheduler)
        roll = PartialRollout(engine, fraction=fraction or 1.0)
        samples, lengths, start = 0, [], time.perf_counter()
        for _ in range(args.steps):
            if fraction is None:
                done = engine.generate(prompts, params, n=args.n)
            else:
                done = roll.step(prompts, params, n=args.n).completions
            samples += len(done)
            lengths += [len(c.token_ids) for c in done]
        elapsed = time.perf_counter() - start
        scheduler.stop()
        out[label] = {
            "step_s": elapsed / args.steps,
            "samples_per_s": samples / elapsed,
            "carried": roll.carried_samples,
            "median_len": statistics.median(lengths),
            "max_len": max(lengths),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="partial rollout steps per side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_checkpoint(Path(tmp) / "model")
        procs, urls = [], []
        for _ in range(3):  # one server alone, then two behind the balancer
            proc, url = start_server(model_dir, args.threads)
            procs.append(proc)
            urls.append(url)
        try:
            tps = throughput_sides(model_dir, args, {"server x1": urls[:1], "server x2": urls[1:]})
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
        partial = partial_rollout_side(model_dir, args)
    load = os.getloadavg()[0]
    print(
        f"machine: {cores} cores, load average {load:.1f}; {args.threads} torch thread(s) a process"
    )
    print(
        f"workload: {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, median of {args.repeats}"
    )
    base = tps["hf_engine"]
    for name, value in tps.items():
        print(f"  {name:18s} {value:9.0f} tokens/s   x{value / base:5.2f} vs hf_engine")
    print(f"partial rollout: {args.steps} steps of {args.prompts} prompts x n={args.n}")
    sync = partial["sync generate"]
    for name, r in partial.items():
        print(
            f"  {name:14s} {r['step_s']:6.2f} s/step  {r['samples_per_s']:6.1f} samples/s"
            f"  x{r['samples_per_s'] / sync['samples_per_s']:4.2f}  carried {r['carried']:3d}"
            f"  len median {r['median_len']:.0f} max {r['max_len']}"
        )


if __name__ == "__main__":
    main()
