"""Per-rank memory and step time of tensor-parallel, pipeline-parallel and data-parallel
trainers against one trainer process.

Starts the trainer of a GRPO run on SmolLM2-135M-Instruct (or ``--model``) as one
process, then as ``--tp`` tensor-parallel processes (``cluster.tensor_parallel``), as
``--pp`` pipeline stages (``cluster.pipeline_parallel``) and as ``--dp`` data-parallel
ranks (FSDP2); 0 or 1 skips a layout. It runs the same ``--steps`` updates on each (old
logprobs, then two optimizer steps on 12 sampled rows). Prints per layout, as JSON:

- ``held_mib``: the model's share on a rank, the float32 weights, gradients and AdamW's
  two moments of the parameter elements it holds (``describe()["parameters_held"]``),
  and ``preflight_held_mib``, the memory preflight's prediction of it;
- ``peak_rss_mib``: each rank's peak resident set during the steps (``VmHWM``, reset
  after the start so the load of the whole checkpoint is not counted), and
  ``rss_after_start_mib``;
- ``median_step_s``: the median wall time of a step (logprobs + update), and the TP
  layouts' ratio of each to one process.

SmolLM2 has 9 heads and 3 KV heads: tensor parallelism of 3 divides it, 2 does not.
On a machine of fewer cores than ranks the step time is the cores', not the layout's.

``--both`` adds ``--pp`` stages of ``--tp`` ranks each; ``--chunk N`` runs the LM head in
chunks of N tokens (``train.logits_chunk_tokens``; under TP each rank's ``[N, V/T]``);
``--micro N`` cuts each optimizer step's 6 rows into micro-batches of N (the pipeline
stages overlap micro-batches: more of them, a smaller bubble).

    python bench/bench_parallel.py --tp 3 --pp 2 --dp 2 --steps 3
    python bench/bench_parallel.py --tp 3 --pp 2 --both --chunk 64 --steps 3
    python bench/bench_parallel.py --model DIR --tp 2 --pp 2 --both --max-tokens 256 --steps 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.real_model: the converted SmolLM2

MIB = 2**20
STATE_BYTES = 16
"""float32 weight, gradient and AdamW's two moments, per parameter element."""


def config(
    out: str, model: str, workers: int, tp: int = 1, pp: int = 1, chunk: int = 0, micro: int = 3
):
    from rlpost.config import load_config

    return load_config(
        None,
        [
            f"run.output_dir={out}",
            "run.threads=1",
            f"model.path={model}",
            "train.mini_batch_size=6",
            f"train.micro_batch_size={micro}",
            "algo.kl.beta=0",
            "cluster.backend=process",
            f"cluster.trainer_workers={workers}",
            f"cluster.tensor_parallel={tp}",
            f"cluster.pipeline_parallel={pp}",
            f"train.logits_chunk_tokens={chunk}",
        ],
    )


def batches(cfg, steps: int, max_tokens: int = 16) -> list:
    from rlpost.algos import get_advantage_estimator, scores_to_token_rewards
    from rlpost.pipeline import build
    from rlpost.rollout.engines.hf import HFEngine
    from rlpost.rollout.engines.protocol import SamplingParams
    from rlpost.train.batch import collate

    model, tok = build.build_policy(cfg)
    prompts = ["What is 12 + 7?", "What is 3 - 9?", "What is 20 + 11?"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in prompts]
    out = []
    for seed in range(steps):
        cs = HFEngine(model, tok, seed=seed).generate(
            ids, SamplingParams(max_tokens=max_tokens), n=4
        )
        b = collate(cs, [float((i + seed) % 4 < 2) for i in range(len(cs))], tok.pad_token_id)
        b.advantages, _ = get_advantage_estimator("grpo")(
            scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
        )
        out.append(b)
    return out


def status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def measure(cfg, run_dir: Path, data: list) -> dict:
    from rlpost.cluster.process import start_trainers
    from rlpost.cluster.trainer_group import TrainerGroup

    trainer = start_trainers(cfg, run_dir)
    handles = trainer.handles if isinstance(trainer, TrainerGroup) else [trainer]
    try:
        pids = [h.pid for h in handles]
        held = trainer.describe()["parameters_held"]
        after_start = [status_mib(p, "VmRSS") for p in pids]
        for p in pids:  # 5: reset the peak resident set to the current one
            Path(f"/proc/{p}/clear_refs").write_text("5")
        times = []
        for b in data:
            b = copy.deepcopy(b)
            t = time.perf_counter()
            b.old_logprobs = trainer.logprobs(b, "old")
            stats = trainer.update(b, beta=0.0).stats
            times.append(time.perf_counter() - t)
        return {
            "ranks": len(pids),
            "held_mib": round(held * STATE_BYTES / MIB, 1),
            "rss_after_start_mib": [round(x) for x in after_start],
            "peak_rss_mib": [round(status_mib(p, "VmHWM")) for p in pids],
            "median_step_s": round(statistics.median(times), 3),
            "last_loss": stats["loss"],
            "last_grad_norm": stats["grad_norm"],
        }
    finally:
        trainer.close()


def preflight_held(cfg) -> float:
    """The parameter elements the memory preflight says a rank of ``cfg`` holds."""
    from rlpost.pipeline.memory import model_shape, rank_params

    return rank_params(cfg, model_shape(cfg))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=0, help="data-parallel ranks (FSDP2); 0 skips")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens sampled a response")
    p.add_argument("--both", action="store_true", help="also --pp stages of --tp ranks each")
    p.add_argument(
        "--chunk", type=int, default=0, help="train.logits_chunk_tokens (0: from the vocabulary)"
    )
    p.add_argument(
        "--micro", type=int, default=3, help="train.micro_batch_size (of a mini-batch of 6)"
    )
    args = p.parse_args()
    if args.model is None:
        from tests.real_model import smollm2_dir

        args.model = str(smollm2_dir())
    out = Path(tempfile.mkdtemp())
    t = time.perf_counter()
    data = batches(config(str(out), args.model, 1), args.steps, args.max_tokens)
    print(f"sampled {args.steps} batches in {time.perf_counter() - t:.0f} s", flush=True)
    m, c = args.model, {"chunk": args.chunk, "micro": args.micro}
    layouts = {"one_process": config(str(out), m, 1, **c)}
    if args.tp > 1:
        layouts[f"tp{args.tp}"] = config(str(out), m, args.tp, tp=args.tp, **c)
    if args.pp > 1:
        layouts[f"pp{args.pp}"] = config(str(out), m, args.pp, pp=args.pp, **c)
    if args.both and args.tp > 1 and args.pp > 1:
        ranks = args.pp * args.tp
        layouts[f"pp{args.pp}xtp{args.tp}"] = config(
            str(out), m, ranks, tp=args.tp, pp=args.pp, **c
        )
    if args.dp > 1:
        layouts[f"dp{args.dp}"] = config(str(out), m, args.dp, **c)
    rows = {name: measure(cfg, out, data) for name, cfg in layouts.items()}
    one = rows["one_process"]
    for name, row in rows.items():
        row["preflight_held_mib"] = round(preflight_held(layouts[name]) * STATE_BYTES / MIB, 1)
        if name != "one_process":
            row["held_ratio"] = round(row["held_mib"] / one["held_mib"], 3)
            row["peak_rss_ratio"] = round(max(row["peak_rss_mib"]) / max(one["peak_rss_mib"]), 3)
            row["step_time_ratio"] = round(row["median_step_s"] / one["median_step_s"], 3)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
