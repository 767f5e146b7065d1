"""The decode step's sampling at a real vocabulary: inverse CDF against torch.multinomial.

    python bench/bench_sampler.py                  # 32 rows x 151,936 tokens, 1 and 2 threads
    python bench/bench_sampler.py --rows 64 --vocab 128256

Times, on the same float32 logits and in one run, (a) ``torch.multinomial`` on the
softmax (the draw rlpost used at every vocabulary, and what transformers'
``generate()`` uses) and (b) :func:`rlpost.rollout.engines.protocol.inverse_cdf_sample` on
the same probabilities, then the whole ``sample_tokens`` step (weights, normaliser,
draw, logprob) against the old step (log-softmax, softmax, multinomial). Prints
milliseconds per decode step (median of ``--repeats``) and the ratios; the 1-minute
load average is printed since other processes move both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rlpost.rollout.engines.protocol import SamplingParams, inverse_cdf_sample, sample_tokens


def ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def old_step(logits: torch.Tensor, gen: torch.Generator):
    full = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(-1)
    return tokens, full.gather(-1, tokens[:, None]).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    logits = 3 * torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, dim=-1)
    params = SamplingParams(temperature=1.0, max_tokens=1)
    gen = torch.Generator().manual_seed(1)
    print(f"{args.rows} rows x {args.vocab:,} tokens; load {os.getloadavg()[0]:.2f}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        multi = ms(lambda: torch.multinomial(probs, 1, generator=gen), args.repeats)
        icdf = ms(lambda: inverse_cdf_sample(probs, gen), args.repeats)
        old = ms(lambda: old_step(logits, gen), args.repeats)
        new = ms(lambda: sample_tokens(logits, params, gen), args.repeats)
        print(
            f"threads {threads}: draw multinomial {multi:7.1f} ms, inverse CDF {icdf:6.1f} ms "
            f"({multi / icdf:5.1f}x); whole step old {old:7.1f} ms, new {new:6.1f} ms "
            f"({old / new:4.1f}x)"
        )


if __name__ == "__main__":
    main()
