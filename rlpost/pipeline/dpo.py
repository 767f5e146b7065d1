"""``rlpost dpo``: offline preference optimisation on preference pairs, top to bottom.

    pairs --sft on chosen--> starting policy --frozen copy--> reference log-probs (once)
          --dpo steps--> policy --held-out pairs--> preference accuracy before / after

The run reads the one config tree (``run``, ``model``, ``data``, ``sft``,
``dpo``, ``observe`` sections, as ``rlpost train`` does). The pair tensors and
the update are in :mod:`rlpost.train.dpo`; the optimizer step is the one the
actor and the critic use.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console as RichConsole
from rich.table import Table

from rlpost.config import Config
from rlpost.data.preferences import PreferencePair, load_pairs
from rlpost.data.sampler import PromptSampler
from rlpost.models.loading import load_policy
from rlpost.observe import Recorder
from rlpost.observe.mfu import pick_threads
from rlpost.pipeline import rules
from rlpost.pipeline.console import Console
from rlpost.pipeline.rundir import prepare_run_dir, schedule
from rlpost.train.dpo import attach_reference, dpo_update, encode_pairs, evaluate_pairs
from rlpost.train.sft import sft_train, start_train_state
from rlpost.types import Prompt

# --------------------------------------------------------------------------- run


# Held-out metrics reported before and after training: (key, table label, format).
SUMMARY_ROWS = (
    ("eval_pref_accuracy", "preference accuracy (implicit reward)", ".1%"),
    ("eval_margin", "reward margin", ".3f"),
    ("eval_logp_accuracy", "log p(chosen) > log p(rejected)", ".1%"),
)
SUMMARY_KEYS = tuple(key for key, _, _ in SUMMARY_ROWS)


@dataclass
class DPOResult:
    run_dir: Path
    summary: dict[str, Any]


def _warm_up(cfg: Config, model, tokenizer, train: list[PreferencePair], bar) -> list[float]:
    s = cfg.sft
    if s.steps == 0:
        return []
    task = bar.add_task("sft on chosen", total=s.steps, info="")
    prompts = [Prompt(text=p.prompt, answer=p.chosen) for p in train]
    return sft_train(
        model,
        tokenizer,
        prompts,
        **schedule(s, cfg.run.seed),
        on_step=lambda i, loss: bar.update(task, advance=1, info=f"loss {loss:.3f}"),
    )


def run_dpo(cfg: Config) -> DPOResult:
    """Warm up, store reference log-probs, train with DPO / IPO, report held-out preference."""
    started = time.time()
    torch.manual_seed(cfg.run.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(pick_threads(cfg.run.threads))
    try:
        return _run(cfg, started)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: Config, started: float) -> DPOResult:
    rules.check(cfg, "dpo")
    # Inputs first: a start that fails on them leaves an existing run untouched.
    train_pairs, eval_pairs, counts = load_pairs(cfg.data, cfg.run.seed)
    model, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed
    )
    run_dir, _, _ = prepare_run_dir(cfg, None, prompts=False)
    pad_id, s = tokenizer.pad_token_id, cfg.dpo
    recorder = Recorder(run_dir)
    bar = Console(cfg.observe.progress).progress  # the bar every command shows
    try:
        with bar:
            sft_losses = _warm_up(cfg, model, tokenizer, train_pairs, bar)
            train_set, eval_set = (encode_pairs(p, tokenizer) for p in (train_pairs, eval_pairs))
            for pairs in (train_set, eval_set):
                attach_reference(model, pairs, pad_id, chunk=256)
            first = evaluate_pairs(model, eval_set, pad_id, s)
            recorder.record(0, first)
            last = _train(model, train_set, eval_set, pad_id, cfg, recorder, bar)
    finally:
        recorder.close()
    summary: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        summary[f"{key}_start"], summary[f"{key}_end"] = first[key], last[key]
    summary |= {
        "eval_pairs": len(eval_set),
        "train_pairs": len(train_set),
        "steps": s.steps,
        "loss_type": s.loss_type,
        "beta": s.beta,
        "sft_loss_last": sft_losses[-1] if sft_losses else None,
        "wall_seconds": time.time() - started,
        **counts,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "model")
    if cfg.observe.progress:
        _print_summary(summary, run_dir)
    return DPOResult(run_dir=run_dir, summary=summary)


def _train(model, train_set, eval_set, pad_id, cfg: Config, recorder, bar) -> dict[str, float]:
    """The DPO steps; returns the final held-out metrics."""
    s = cfg.dpo
    optimizer, scheduler, _, _ = start_train_state(model, s.lr, s.warmup_steps, s.steps, 0, None)
    sampler = PromptSampler(list(range(len(train_set))), s.batch_size, seed=cfg.run.seed)
    task = bar.add_task(f"dpo ({s.loss_type})", total=s.steps, info="")
    held = ""
    for step in range(1, s.steps + 1):
        m = dpo_update(model, optimizer, scheduler, train_set, sampler.next_batch(), pad_id, s)
        if s.eval_every and step % s.eval_every == 0 and step < s.steps:
            m.update(evaluate_pairs(model, eval_set, pad_id, s))
            held = f" | held-out acc {m['eval_pref_accuracy']:.1%}"
        recorder.record(step, m)
        info = f"loss {m['loss']:.3f} | margin {m['reward_margin']:.3f}{held}"
        bar.update(task, advance=1, info=info)
    final = evaluate_pairs(model, eval_set, pad_id, s)
    recorder.record(s.steps, final)
    return final


def _print_summary(s: dict[str, Any], run_dir: Path) -> None:
    table = Table(title=f"rlpost dpo {run_dir}")
    for name, justify in (("held-out pairs", "left"), ("start", "right"), ("end", "right")):
        table.add_column(name, justify=justify)
    for key, label, fmt in SUMMARY_ROWS:
        table.add_row(label, format(s[f"{key}_start"], fmt), format(s[f"{key}_end"], fmt))
    table.add_row("steps", "", str(s["steps"]))
    table.add_row("wall time", "", f"{s['wall_seconds']:.0f} s")
    out = RichConsole(stderr=True)
    out.print(table)
    out.print(f"metrics: {run_dir / 'metrics.jsonl'}   summary: {run_dir / 'summary.json'}")
