"""Peak memory and step time of LoRA against full fine-tuning on the ~25M-parameter model.

Each mode runs in its own process (peak RSS is per process): build the model, then a few
RL-shaped update steps on a [batch, length] token block: policy forward + backward,
reference forward (full: a frozen copy; LoRA: the same model with adapters disabled),
AdamW step. Prints the peak RSS of each, the part of it above the loaded model (optimizer state,
gradients, the reference, activations) and their ratio, measured in the same run.

    python bench/bench_lora_memory.py [--steps 3] [--batch 16] [--length 64] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run_mode(mode: str, steps: int, batch: int, length: int, rank: int) -> dict:
    import torch

    from rlpost.models.loading import frozen_copy
    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(1)
    shape = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8)
    model = build_tiny_model(build_char_tokenizer(), num_attention_heads=8, **shape)
    params = sum(p.numel() for p in model.parameters())
    if mode == "lora":
        import peft  # noqa: F401  (imported before the baseline, like everything else)
    baseline_mb = _rss_mb()
    if mode == "lora":
        from rlpost.models.lora import (
            LoRASettings,
            apply_lora,
            reference_mode,
            trainable_parameters,
        )

        model = apply_lora(model, LoRASettings(rank=rank, alpha=2 * rank))
        trained, ref_ctx, ref = trainable_parameters(model), (lambda: reference_mode(model)), model
    else:
        import contextlib

        trained, ref_ctx, ref = list(model.parameters()), contextlib.nullcontext, frozen_copy(model)
    opt = torch.optim.AdamW(trained, lr=1e-5)
    ids = torch.randint(4, 90, (batch, length))
    start = time.perf_counter()
    for _ in range(steps):
        with torch.no_grad(), ref_ctx():
            ref(input_ids=ids).logits.float().log_softmax(-1)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    step_s = (time.perf_counter() - start) / steps
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    state += [p.grad for p in trained if p.grad is not None]
    state += list(ref.parameters()) if ref is not model else []
    return {
        "state_mb": sum(t.numel() * t.element_size() for t in state) / 2**20,
        "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "mode": mode,
        "params": params,
        "trainable": sum(p.numel() for p in trained),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "training_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mb,
        "step_seconds": step_s,
    }


def _rss_mb() -> float:
    """Resident memory now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.steps, args.batch, args.length, args.rank)))
        return 0
    rows = {}
    for mode in ("full", "lora"):
        argv = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
        r = rows[mode]
        print(
            f"{mode:>4}: {r['trainable'] / 1e6:5.2f}M of {r['params'] / 1e6:.2f}M parameters "
            f"trained; weights {r['weights_mb']:4.0f} MB, gradients + optimizer + reference "
            f"{r['state_mb']:4.0f} MB; peak RSS {r['peak_rss_mb']:5.0f} MB "
            f"({r['training_mb']:4.0f} MB above the loaded model); {r['step_seconds']:.2f} s/step"
        )
    full, lora = rows["full"], rows["lora"]
    print(
        f"lora / full: weights + training state "
        f"{(lora['weights_mb'] + lora['state_mb']) / (full['weights_mb'] + full['state_mb']):.2f}x, "
        f"peak RSS {lora['peak_rss_mb'] / full['peak_rss_mb']:.2f}x, "
        f"step time {lora['step_seconds'] / full['step_seconds']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
