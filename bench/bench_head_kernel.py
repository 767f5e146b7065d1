"""The LM head's matmul at a real vocabulary: torch's kernel (MKL's sgemm on x86), fresh and
into a reused output, against oneDNN's linear, which :func:`rlpost.train.lm_head.head_linear`
takes, in one run. The trainer's float32 chunks take the reused output on an Intel CPU and
oneDNN's elsewhere (``lm_head._chunk_onednn``); an engine's decode head takes oneDNN's.

    python bench/bench_head_kernel.py                     # 151,936 x 256, 1 and 2 threads
    python bench/bench_head_kernel.py --rows 32 --threads 2

``rows`` x ``hidden`` states times a ``[vocab, hidden]`` head, float32, no gradient: 32 rows
is a decode step of 4 prompts x 8 samples, 110 one chunk of the trainer's head (64 MiB of
logits). Rounds alternate the two kernels; each time is the median of its rounds. Prints
milliseconds, GFLOP/s and the ratio (torch's time over oneDNN's), and the largest
difference of the outputs (float rounding). A fresh output of more than 32 MiB (glibc's largest
mmap threshold) is mapped and faulted in anew each call; a reused one is not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlpost.train.lm_head import _onednn_linear, head_linear


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", default="8,32,110,220")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    if not _onednn_linear():
        raise SystemExit("this torch build has no working oneDNN linear: head_linear is torch's")
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden) * 0.02
    print(f"head {args.vocab:,} x {args.hidden}, float32, torch {torch.__version__}")
    print(
        "| threads | rows | torch ms (GFLOP/s) | torch, reused output | oneDNN ms (GFLOP/s) "
        "| torch / oneDNN | reused / oneDNN | max diff |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden)
            out = torch.empty(rows, args.vocab)
            kernels = {
                "torch": lambda x=x: torch.nn.functional.linear(x, weight),
                "reused": lambda x=x, out=out: torch.mm(x, weight.t(), out=out),
                "onednn": lambda x=x: head_linear(x, weight),
            }
            for fn in kernels.values():
                fn()  # warm-up: first-touch of the output, kernel selection
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(args.rounds):
                for name, fn in kernels.items():
                    times[name].append(timed(fn))
            med = {k: statistics.median(v) for k, v in times.items()}
            flops = 2 * rows * args.hidden * args.vocab
            diff = float((kernels["torch"]() - kernels["onednn"]()).abs().max())
            cells = [f"{med[k] * 1e3:.1f} ({flops / med[k] / 1e9:.0f})" for k in kernels]
            print(
                f"| {threads} | {rows} | {cells[0]} | {cells[1]} | {cells[2]} | "
                f"**{med['torch'] / med['onednn']:.2f}x** | "
                f"**{med['reused'] / med['onednn']:.2f}x** | {diff:.1e} |"
            )


if __name__ == "__main__":
    main()
