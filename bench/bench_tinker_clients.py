"""Training clients on one base through ``rlpost tinker``: the service's memory against the
estimate of base + N adapters with their AdamW state, then seconds per step of an SDK loop.

Starts ``rlpost tinker --model MODEL --device DEVICE``; loads the base (a base-model sampler's
``compute_logprobs``) and reads the service's RSS; then ``--clients`` LoRA training clients
(the SDK's defaults: attention, MLP and the head) each run one ``forward_backward`` and
``optim_step``, and the RSS is read again, against base + N x (adapter, its gradient and
AdamW's two moments: ``Base.estimate_bytes``) + 10 % (the bar; on cuda the adapters are GPU
memory and the RSS bar does not apply). Last the first client runs ``--steps`` iterations of
``sample`` (``--samples`` x ``--max-tokens``), ``forward_backward("importance_sampling")`` and
``optim_step``, printing each iteration's seconds and loss.

    python bench/bench_tinker_clients.py --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        [--device cpu] [--clients 4] [--steps 3] [--rank 32] [--samples 4] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start(model: str, state_dir: str, device: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rlpost.tinker.service", "--model", model,
           "--port", "0", "--state-dir", state_dir, "--device", device]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(300)
    if not lines or "listening on" not in lines[0]:
        proc.kill()
        raise SystemExit(f"rlpost tinker did not start: {lines}")
    return proc, lines[0].split("listening on ")[1].split()[0]


def rss(pid: int) -> int:
    """The resident set of process ``pid`` in bytes (/proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def step(tc, prompt: list[int], completions: list[tuple[list[int], list[float]]]) -> float:
    """One forward_backward("importance_sampling") + optim_step on ``completions`` of
    ``prompt`` ((tokens, logprobs) each, advantages alternating -1, +1); the loss."""
    from tinker import types

    data, p = [], len(prompt) - 1
    for i, (tokens, logprobs) in enumerate(completions):
        seq, adv = [*prompt, *tokens], 1.0 if i % 2 else -1.0
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "logprobs": [0.0] * p + list(logprobs),
                            "advantages": [0.0] * p + [adv] * len(tokens)},
        ))  # fmt: skip
    out = tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    return out.metrics["loss:sum"]


def iteration(tc, prompt: list[int], args) -> tuple[float, float]:
    """(seconds, loss) of one sample + forward_backward + optim_step."""
    from tinker import types

    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), args.samples, params).result()
    loss = step(tc, prompt, [(s.tokens, s.logprobs) for s in seqs.sequences])
    return time.perf_counter() - t0, loss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    import tinker
    from tinker import types

    import rlpost.api as api

    model = str(Path(args.model).expanduser())
    adapter = api.Base.load(model).estimate_bytes(api.LoRA(rank=args.rank, train_unembed=True))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc, url = start(model, tmp, args.device)
        try:
            service = tinker.ServiceClient(base_url=url)
            base_sampler = service.create_sampling_client(base_model=model).result()
            prompt = base_sampler.get_tokenizer().encode("Question: what is 12 + 7? Answer:")
            base_sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
            base = rss(proc.pid)
            print(f"service up and base loaded in {time.perf_counter() - t0:.1f} s "
                  f"({args.device}); RSS {base / 2**20:.0f} MiB")  # fmt: skip
            fixed = [(list(range(100, 100 + 8 * (i + 1))), [-1.0] * 8 * (i + 1)) for i in range(4)]
            clients, losses = [], []
            for _ in range(args.clients):
                tc = service.create_lora_training_client(base_model=model, rank=args.rank).result()
                clients.append(tc)
                losses.append(step(tc, prompt, fixed))
            after = rss(proc.pid)
            for i in range(args.steps):
                seconds, loss = iteration(clients[0], prompt, args)
                losses.append(loss)
                print(f"step {i}: {seconds:.2f} s, loss {loss:.6g}")
            service.close("success").result()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    bound = 1.1 * (base + args.clients * adapter)
    print(f"adapter + gradient + AdamW moments (rank {args.rank}): {adapter / 2**20:.1f} MiB")
    print(f"RSS after {args.clients} clients: {after / 2**20:.0f} MiB; estimate base + "
          f"{args.clients} adapters {(base + args.clients * adapter) / 2**20:.0f} MiB, bar "
          f"(+10 %) {bound / 2**20:.0f} MiB: {'holds' if after <= bound else 'MISSED'}")  # fmt: skip
    print(f"losses: {', '.join(f'{x:.6g}' for x in losses)}")
    return 0 if all(map(math.isfinite, losses)) else 1


if __name__ == "__main__":
    sys.exit(main())
