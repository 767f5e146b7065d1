"""One RL step of a recipe on a tiny model, through the loop's own wiring, and what it moved.

``probe(cfg)`` builds the three workers from ``cfg`` the way ``loop.train`` does
(``build.build_*``, ``loop._new_run``, ``loop._deliverer``, ``loop._feed``), runs
``loop.rl_step`` once, sends the new weights the way the loop does, and returns
fingerprints of what each section of the config acts on:

- ``batch``: the sampled token ids (rollout);
- ``scores``: the rewards, and which were invalid (reward);
- ``update``: the trainer's weights after the step and its loss statistics (algo, train);
- ``sync``: the bytes and checksums the weight path reports (sync);
- ``beta``: the KL coefficient after the step (the KL controller);
- ``samples``: the sample file the step wrote (reward.sample_*);
- ``passes``: forward passes of the trainer's model and tokens the engine's model read
  (the batch-size and prefix-sharing knobs move work, not results).

``spread_reward`` gives every group a spread on an untrained model, so an update moves.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from rlpost.config import Config
from rlpost.pipeline import build, loop, rules
from rlpost.pipeline.feeds import PromptSource
from rlpost.pipeline.weights import build_weight_path
from rlpost.pipeline.workers import Workers
from rlpost.resolved import resolve


def spread_reward(sample, **_):
    """0, 0.5 or 1 from the completion's characters: groups of an untrained policy differ."""
    return (sum(map(ord, sample.completion)) % 3) / 2


def _counter(model, counts: dict, key: str):
    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts[key] += 1
        counts[key + "_tokens"] += int(ids.numel()) if ids is not None else 0

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _digest(values) -> str:
    return hashlib.sha256(repr(values).encode()).hexdigest()[:16]


def weights_digest(tensors) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _rounded(stats: dict, keys) -> tuple:
    out = []
    for k in keys:
        v = stats.get(k)
        nan = isinstance(v, float) and math.isnan(v)
        out.append((k, None if v is None or nan else round(v, 9)))
    return tuple(out)


# metrics that measure time, not what was computed
TIMED = ("seconds", "tps", "utilization", "mfu", "throughput", "_time")


def probe(cfg: Config, prompts, model_state: dict, run_dir: Path, steps: int = 1) -> dict[str, str]:
    """Fingerprints of ``steps`` loop steps of ``cfg`` (see the module docstring)."""
    rules.check(cfg)
    torch.manual_seed(cfg.run.seed)
    model, tokenizer = build.build_policy(cfg)
    model.load_state_dict(model_state)
    facts = resolve(cfg)
    rollout = build.build_rollout_worker(cfg, model, tokenizer, facts=facts)
    trainer = build.build_trainer_worker(cfg, model, tokenizer, facts=facts)
    workers = Workers(trainer, rollout, build.build_reward_worker(cfg))
    run_dir.mkdir(parents=True, exist_ok=True)
    seen, metrics, sent = [], {}, {}
    counts = {"trainer": 0, "trainer_tokens": 0, "engine": 0, "engine_tokens": 0}
    hooks = [_counter(trainer.trainer.model, counts, "trainer")]
    engine = getattr(rollout.engine, "engine", rollout.engine)  # an agent harness wraps one
    engine = getattr(engine, "scheduler", engine)  # the continuous engine's: its scheduler's
    if hasattr(engine, "model"):
        hooks.append(_counter(engine.model, counts, "engine"))
    r = loop._new_run(cfg, facts, run_dir, workers, prompts, None)
    try:
        r.on_groups = lambda step, groups: seen.extend(groups)
        r.weights = build_weight_path(cfg, rollout, run_dir)
        loop._push(r)
        r.weights.take_sent()
        r.feed = loop._feed(r, PromptSource(r.sampler, []), 0)
        for step in range(steps):
            m, _ = loop.rl_step(r, step)
            metrics.update(m)
            sent = r.feed.push(trainer.export_weights())
        r.feed.close()
        weights = weights_digest(trainer.export_weights().tensors)
        for h in hooks:
            h.remove()
    finally:
        r.recorder.close()
        if r.weights is not None:
            r.weights.close()
        workers.close()
    completions = [c for g in seen for c in g.completions]
    samples = (
        sorted((run_dir / "samples").glob("*.jsonl")) if (run_dir / "samples").exists() else []
    )
    return {
        "batch": _digest([(c.prompt_ids, c.token_ids) for c in completions]),
        "scores": _digest(
            ([(g.scores, g.invalid) for g in seen], metrics.get("verifiable_accuracy"))
        ),
        "update": _digest((weights, _rounded(metrics, sorted(k for k in metrics if not timed(k))))),
        "sync": _digest(sorted((k, round(v, 6)) for k, v in sent.items() if not timed(k))),
        "beta": _digest(round(r.kl_coef.beta, 12)),
        "samples": _digest([p.read_text() for p in samples]),
        "passes": _digest(counts),
        "metrics": _digest(_rounded(metrics, sorted(k for k in metrics if not timed(k)))),
        "rounds": _digest(metrics.get("sampling_rounds")),
    }


def timed(key: str) -> bool:
    return any(t in key for t in TIMED)
