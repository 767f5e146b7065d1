"""The chunked LM head's forward and backward at a real vocabulary, against the full
logits and against the head of earlier revisions, in one run.

    python bench/bench_lm_head.py                       # 1,024 tokens, 151,936 x 256, one thread
    python bench/bench_lm_head.py --revs b69c4ac,HEAD   # also the head as it was at those commits

Each contender computes the logprobs of ``--tokens`` target tokens from random hidden
states through one ``[V, H]`` head and backpropagates ``0.01 * sum(logprobs)`` into
the hidden states and the head weight: ``full`` is ``log_softmax(h W^T)`` over the
whole ``[N, V]`` logits (autograd keeps them), ``chunked`` is
:func:`rlpost.train.lm_head.head_logprobs` of this tree, ``REV`` the same file at a
git revision. Rounds alternate the contenders; a contender's time is its best round.
Prints seconds, the ratio to ``full``, and the logprob sum and gradient norms (equal
to float rounding across contenders).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def head_at(rev: str):
    """rlpost/train/lm_head.py as it was at ``rev``, imported on its own."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:rlpost/train/lm_head.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="lm-head-")) / f"lm_head_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.head_logprobs


def full_logprobs(hidden, head, targets):
    logits = hidden @ head.weight.t()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--revs", default="", help="git revisions whose head to time too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from rlpost.train.lm_head import head_logprobs

    sides = {"full": full_logprobs, "chunked": head_logprobs}
    sides |= {rev: head_at(rev) for rev in filter(None, args.revs.split(","))}
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    best: dict[str, float] = {}
    checks: dict[str, tuple[float, float, float]] = {}
    print(
        f"{args.tokens} tokens, head {args.vocab:,} x {args.hidden}, {args.threads} thread(s), "
        f"load {os.getloadavg()[0]:.2f}"
    )
    for _ in range(args.rounds):
        for name, fn in sides.items():
            h = hidden.clone().requires_grad_(True)
            head.weight.grad = None
            start = time.perf_counter()
            lp, _ = fn(h, head, targets)
            (0.01 * lp.sum()).backward()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
            checks[name] = (
                float(lp.detach().sum()),
                float(h.grad.norm()),
                float(head.weight.grad.norm()),
            )
    for name in sides:
        lp, gh, gw = checks[name]
        print(
            f"  {name:>10}: {best[name]:6.2f} s  {best['full'] / best[name]:5.2f}x full   "
            f"sum logp {lp:.6g}  |dh| {gh:.6g}  |dW| {gw:.6g}"
        )


if __name__ == "__main__":
    main()
