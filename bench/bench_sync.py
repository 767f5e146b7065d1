"""Weight sync: seconds and bytes per sync for each channel x codec, against today's push.

For each model (built in memory with random weights, nothing downloaded):

* ``tiny``: rlpost's built-in tiny Llama;
* ``25M``: a Llama of about 25M parameters;
* ``qwen0.5b``: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
  MLP 4864, vocab 151936, tied embeddings, attention biases) as a Llama config, so
  the built-in character tokenizer can be saved with it for ``rlpost serve``;
  ``--qwen-layers`` cuts its depth to fit a small machine.

one Adam step at lr 1e-6 is taken on random tokens (so ``bf16+delta`` sends
what one RL step changes; Adam's first step is applied in place, without
optimizer state), and the weights are pushed through every channel:

* ``inprocess``: the staged receiver around an HFEngine in this process;
* ``http``: one ``rlpost serve`` process on 127.0.0.1 (bucketed ``/v1/sync``);
* ``disk``: publish a version directory, then an HFEngine here loads it;
* ``gloo``: torch.distributed to an HFEngine in a second (spawned) process;

with each codec: ``none`` (float32), ``bf16``, ``fp8``, ``mxfp4`` and ``bf16+delta``
(its base is the version before the step, pushed untimed); ``fp8-all`` is fp8 that
also quantises the embeddings and lm_head (``keep_bf16=norm``), for the byte ratio
on models whose embedding is a large share of the weights. Printed per model: seconds,
bytes on the wire (bucket payloads) and generation pause for each cell; then the ratios:
fp8 / bf16 bytes, delta / bf16 bytes, and the server's peak extra memory (VmHWM after the
push minus VmRSS before it, peak reset through /proc/PID/clear_refs) for each
``--bucket-mb``.

    python bench/bench_sync.py                                   # the full matrix
    python bench/bench_sync.py --models tiny,25M,qwen0.5b --qwen-layers 4 --transports inprocess,http,gloo

Every cell is the median of ``--repeats`` pushes; every process uses
``--threads`` torch threads (default 1). Timings move with machine load: read
them against the baseline of the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpost.models.tiny import build_char_tokenizer
from rlpost.rollout.engines.hf import HFEngine
from rlpost.sync import Receiver
from rlpost.sync.codecs import DEFAULT_KEEP_BF16
from rlpost.sync.disk import DiskTransport, load_latest
from rlpost.sync.gloo import GlooLink, GlooTransport, serve_gloo
from rlpost.sync.transports import HttpTransport, InProcessTransport, TransportOptions
from rlpost.sync.weight_sync import MB, WeightSync

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' shared helpers
import serve_util

CODECS = ("none", "bf16", "fp8", "fp8-all", "mxfp4", "bf16+delta")
TIMEOUT_S = 900.0


def model_config(name: str, qwen_layers: int) -> LlamaConfig:
    tok = build_char_tokenizer()
    common = {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    common |= {"pad_token_id": tok.pad_token_id, "max_position_embeddings": 256}
    if name == "tiny":
        shape = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2}
        shape |= {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True}
    elif name == "25M":
        shape = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8}
        shape |= {"num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192}
        shape |= {"tie_word_embeddings": False}
    elif name == "qwen0.5b":
        shape = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": qwen_layers}
        shape |= {"num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}
        shape |= {"tie_word_embeddings": True, "attention_bias": True, "rms_norm_eps": 1e-6}
    else:
        raise SystemExit(f"unknown model {name!r}; valid: tiny, 25M, qwen0.5b")
    return LlamaConfig(**(common | shape))


def build_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def empty_engine(config: LlamaConfig) -> HFEngine:
    """An engine holding a model of ``config`` with uninitialised weights (they are synced in)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    return HFEngine(model, build_char_tokenizer())


@torch.no_grad()
def _adam_first_step(model: torch.nn.Module, lr: float, eps: float = 1e-8) -> None:
    # Adam's first step, bias-corrected, is lr * g / (|g| + eps) (m = g, v = g^2): applied
    # in place, so a 0.5B model does not need 4 GB of optimizer state for one step.
    for p in model.parameters():
        if p.grad is not None:
            p -= lr * p.grad / (p.grad.abs() + eps)


def optimizer_step(model: torch.nn.Module, lr: float, before: dict[str, torch.Tensor]) -> float:
    """One Adam step at ``lr`` on random tokens; the fraction of bf16 patterns it changed."""
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    _adam_first_step(model, lr)
    model.zero_grad(set_to_none=True)
    changed = sum(
        (p.detach().to(torch.bfloat16).view(torch.int16) != before[n].view(torch.int16))
        .sum()
        .item()
        for n, p in model.named_parameters()
    )
    return changed / sum(p.numel() for p in model.parameters())


def release_memory() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise), to share the machine."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass  # not glibc: nothing to trim, the measurement only gets a little noisier


def params(model: torch.nn.Module):
    return ((n, p.detach()) for n, p in model.named_parameters())


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADMIN = "bench-sync-admin"  # the server's /v1/sync needs an admin key


def start_server(model_dir: Path, threads: int) -> tuple[subprocess.Popen, str]:
    env = {"RLPOST_ADMIN_KEY": ADMIN}
    return serve_util.start_server(model_dir, "--threads", str(threads), env=env)


def rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def peak_extra_mb(pid: int, fn) -> tuple[float, object]:
    """Run ``fn()``; the server's peak RSS during it above its RSS before it [MiB]."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = rss_kb(pid, "VmRSS")
    out = fn()
    return (rss_kb(pid, "VmHWM") - before) / 1024, out


def gloo_receiver(config: LlamaConfig, link: GlooLink, threads: int) -> None:
    torch.set_num_threads(threads)
    serve_gloo(empty_engine(config), link, 1, timeout_s=TIMEOUT_S)


# ------------------------------------------------------------------ measuring


def measure(
    transports, codec: str, bucket_mb: float, model, before, version: int, repeats: int
) -> dict:
    """The median of ``repeats`` timed pushes of ``model``; delta first pushes ``before``, its base."""
    delta = codec == "bf16+delta"
    sync = WeightSync(
        transports,
        codec="bf16" if delta else codec.removesuffix("-all"),
        bucket_bytes=int(bucket_mb * MB),
        delta=delta,
        keep_bf16=("norm",) if codec.endswith("-all") else DEFAULT_KEEP_BF16,
    )
    runs = []
    for i in range(repeats):
        if delta:
            sync.push(before.items(), version + 2 * i)
        stats = sync.push(params(model), version + 2 * i + 1)
        if stats.failed:
            raise SystemExit(f"sync failed: {stats.failed}")
        runs.append(stats)
    mid = sorted(runs, key=lambda s: s.seconds)[len(runs) // 2]  # the median push
    return {"seconds": mid.seconds, "bytes": mid.bytes, "pause": mid.pause_seconds}


def run_model(name: str, args, out: dict) -> None:
    config = model_config(name, args.qwen_layers)
    model = build_model(config)
    # The version before the step, in bf16: the delta's base (bf16 is what delta compares).
    before = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    changed = optimizer_step(model, args.lr, before)
    release_memory()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"\n== {name}: {n_params / 1e6:.1f}M parameters; one Adam step at lr {args.lr:g} "
        f"changed {changed:.2%} of bf16 patterns",
        flush=True,
    )
    rows: dict[tuple[str, str], dict] = {}
    version = 10
    for transport in args.transports:
        for setup in _setups(transport, name, config, model, args, rows):
            with setup as transports:
                for codec in args.codecs:
                    version += 2 * args.repeats
                    rows[(transport, codec)] = measure(
                        transports, codec, args.bucket_mb, model, before, version, args.repeats
                    )
                    release_memory()
                    r = rows[(transport, codec)]  # as it goes, so a cut-short run still reports
                    print(
                        f"  {transport} {codec}: {r['seconds']:.3f} s, {r['bytes'] / MB:.2f} MB",
                        flush=True,
                    )
    out[name] = rows
    print_table(name, rows, args)


def _setups(transport: str, name, config, model, args, rows):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    options = TransportOptions(timeout_s=TIMEOUT_S, headers=headers)
    if transport == "inprocess":
        yield _Ctx(lambda: [InProcessTransport(empty_engine(config), options)])
    elif transport == "http":
        yield _HttpCtx(name, config, model, args, rows, options)
    elif transport == "disk":
        yield _DiskCtx(config, options)
    elif transport == "gloo":
        yield _GlooCtx(config, args, options)
    else:
        raise SystemExit(f"unknown transport {transport!r}")


class _Ctx:
    def __init__(self, make) -> None:
        self.make = make

    def __enter__(self):
        self.transports = self.make()
        return self.transports

    def __exit__(self, *exc) -> None:
        for t in self.transports:
            t.close()


class _HttpCtx:
    """A server process; its peak extra memory per bucket size is measured on entry."""

    def __init__(self, name, config, model, args, rows, options) -> None:
        self.name, self.config, self.model, self.args, self.rows = name, config, model, args, rows
        self.options = options

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-sync-")
        d = Path(self.tmp.name) / "model"
        self.model.save_pretrained(d)
        build_char_tokenizer().save_pretrained(d)
        self.proc, url = start_server(d, self.args.threads)
        self.transport = HttpTransport(url, self.options)
        for mb in self.args.memory_bucket_mb:
            sync = WeightSync([self.transport], codec="none", bucket_bytes=int(mb * MB))
            mem, stats = peak_extra_mb(self.proc.pid, lambda s=sync: s.push(params(self.model), 2))
            self.rows[(f"http@{mb:g}MB", "none")] = {
                "seconds": stats.seconds,
                "bytes": stats.bytes,
                "pause": stats.pause_seconds,
                "mem_mb": mem,
            }
        return [self.transport]

    def __exit__(self, *exc) -> None:
        self.transport.close()
        self.proc.terminate()
        self.proc.wait()
        self.tmp.cleanup()


class _DiskCtx:
    """Publishing and loading are one cell: the sender writes, an engine here reads it back."""

    class _WriteThenRead(DiskTransport):
        def __init__(self, root, options, reader: Receiver) -> None:
            super().__init__(root, options)
            self.reader = reader

        def finish(self, manifest):
            report = super().finish(manifest)
            load_latest(self.root, self.reader)
            return report

    def __init__(self, config, options) -> None:
        self.config, self.options = config, options

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-sync-disk-")
        reader = Receiver(empty_engine(self.config), name="disk reader")
        self.t = self._WriteThenRead(Path(self.tmp.name) / "weights", self.options, reader)
        self.t.supports_delta = True  # one known reader, so a delta base is well defined here
        return [self.t]

    def __exit__(self, *exc) -> None:
        self.t.close()
        self.tmp.cleanup()


class _GlooCtx:
    def __init__(self, config, args, options) -> None:
        self.config, self.args, self.options = config, args, options

    def __enter__(self):
        link = GlooLink("127.0.0.1", free_port(), world_size=2)
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=gloo_receiver, args=(self.config, link, self.args.threads))
        self.proc.start()
        self.t = GlooTransport(link, self.options)
        return [self.t]

    def __exit__(self, *exc) -> None:
        self.t.close()
        self.proc.join(60)


# ------------------------------------------------------------------ printing


def print_table(name: str, rows: dict, args) -> None:
    print(
        f"{'channel':<14}{'codec':<12}{'seconds':>9}{'MB on wire':>12}{'pause s':>9}{'server +MB':>12}"
    )
    for (transport, codec), r in rows.items():
        mem = f"{r['mem_mb']:.1f}" if "mem_mb" in r else ""
        print(
            f"{transport:<14}{codec:<12}{r['seconds']:>9.3f}{r['bytes'] / MB:>12.2f}{r['pause']:>9.3f}{mem:>12}"
        )
    for transport in args.transports:
        bf16 = rows.get((transport, "bf16"))
        if bf16 is None:
            continue
        parts = []
        if (transport, "fp8-all") in rows:
            ratio = rows[(transport, "fp8-all")]["bytes"] / bf16["bytes"]
            parts.append(f"fp8-all/bf16 bytes {ratio:.3f}")
        if (transport, "fp8") in rows:
            parts.append(
                f"fp8/bf16 bytes {rows[(transport, 'fp8')]['bytes'] / bf16['bytes']:.3f} (target <= 0.52)"
            )
        if (transport, "bf16+delta") in rows:
            parts.append(
                f"delta/bf16 bytes {rows[(transport, 'bf16+delta')]['bytes'] / bf16['bytes']:.4f} (target <= 0.1)"
            )
        print(f"  {transport}: " + "; ".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="tiny,25M,qwen0.5b")
    ap.add_argument(
        "--qwen-layers", type=int, default=24, help="depth of the qwen0.5b shape (24: the real one)"
    )
    ap.add_argument("--transports", default="inprocess,http,disk,gloo")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of the matrix")
    ap.add_argument(
        "--memory-bucket-mb", default="16,64", help="bucket sizes for the server memory check"
    )
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=3, help="timed pushes per cell (median)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    args.transports = args.transports.split(",")
    args.codecs = args.codecs.split(",")
    args.memory_bucket_mb = [float(x) for x in args.memory_bucket_mb.split(",") if x]
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(
        f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; threads {args.threads}"
    )
    out: dict = {}
    for name in args.models.split(","):
        run_model(name, args, out)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
