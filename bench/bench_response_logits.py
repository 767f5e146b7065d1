"""The trainer's LM head on the response positions only, against the full head, in one run.

    python bench/bench_response_logits.py                    # vocab 32000, prompt 256, response 64
    python bench/bench_response_logits.py --vocab 151936 --prompt 512 --response 128 --rows 4

A Llama-family model built from a config (nothing downloaded) with a real-size
vocabulary; one forward and backward of the responses' summed logprobs per
round, as the policy loss runs them, with ``response_logits`` as the trainer
calls it (the head on the last ``T + 1`` positions, ``logits_to_keep``) and with
the same model behind a wrapper that hides that argument (the full head over
``P + T`` positions, what the trainer did before). Rounds alternate; prints the
median seconds of each, the ratio, and the bytes of the logits each keeps
alive for the backward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpost.train.batch import collate, response_logits, token_logprobs
from rlpost.types import Completion


class FullHead(torch.nn.Module):
    """The model with a forward that has no ``logits_to_keep``: the head runs everywhere."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.prompt + args.response + 8,
    )
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    rows = [
        Completion(
            torch.randint(1, args.vocab, (args.prompt,), generator=gen).tolist(),
            torch.randint(1, args.vocab, (args.response,), generator=gen).tolist(),
            [0.0] * args.response,
            "stop",
            0,
            0,
        )
        for _ in range(args.rows)
    ]
    batch = collate(rows, [1.0] * args.rows, 0)
    contenders = {"response head": model, "full head": FullHead(model)}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    logit_bytes = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, m in contenders.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            logits = response_logits(m, batch)
            lp = token_logprobs(logits, batch.responses)
            (lp * batch.response_mask).sum().backward()
            elapsed = time.perf_counter() - t0
            if r:
                times[name].append(elapsed)
            base = logits._base if logits._base is not None else logits
            logit_bytes[name] = base.numel() * base.element_size()
    load = os.getloadavg()[0]
    print(
        f"vocab {args.vocab}, {args.rows} rows x (prompt {args.prompt} + response "
        f"{args.response}), hidden {args.hidden}, {args.layers} layers, {args.threads} thread(s), "
        f"load {load:.1f}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in contenders:
        print(
            f"  {name:<14} {med[name] * 1000:8.1f} ms forward+backward   "
            f"logits {logit_bytes[name] / 2**20:8.1f} MiB"
        )
    print(f"  ratio: {med['full head'] / med['response head']:.2f}x faster")


if __name__ == "__main__":
    main()
