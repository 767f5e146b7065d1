"""``rlpost sft`` (conversations), ``rlpost dpo`` and ``rlpost rm``, top to bottom.

    rows --check--> an objective (rlpost.train.sft, .dpo, .reward_model) --the offline loop
        (rlpost.train.offline)--> RUN_DIR/<model>; held-out metrics at start, every eval_every, end

Bad rows are reported as in a run (console and ``RUN_DIR/data_report.json``); checkpoints in
``RUN_DIR/<state>`` resume with ``--resume RUN_DIR`` as a run that never stopped.
:func:`train_stage` holds what the commands share."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console as RichConsole
from rich.table import Table

from rlpost.config import Config, DPOConfig, RMConfig
from rlpost.data.conversations import (
    Conversation,
    chat_arith,
    encode_conversations,
    ensure_chat_template,
    load_conversation_file,
    prompt_for_answer,
)
from rlpost.data.files import DataError, LoadReport
from rlpost.data.preferences import load_pairs, load_pairs_reported
from rlpost.models.loading import load_policy
from rlpost.observe import Recorder
from rlpost.observe.mfu import pick_threads
from rlpost.pipeline import build, rules
from rlpost.pipeline.console import Console
from rlpost.pipeline.interrupts import stop_requested
from rlpost.pipeline.preflight import data_counts, report_data
from rlpost.pipeline.rundir import (
    SFT_STATE,
    on_run_device,
    open_stage_run_dir,
    prepare_run_dir,
    schedule,
)
from rlpost.rewards.verifiable import exact_match, numeric_match
from rlpost.train.batch import model_device
from rlpost.train.dpo import DPO, attach_reference, encode_pairs, evaluate_pairs
from rlpost.train.offline import Schedule, save_model, saved_state, train_offline
from rlpost.train.reward_model import BradleyTerry, evaluate_rm, reward_model_from
from rlpost.train.reward_model import encode_pairs as encode_rm_pairs
from rlpost.train.sft import SFT, greedy_replies, mean_nll
from rlpost.types import Prompt, RewardSample

RM_STATE, RM_MODEL = "rm_state", "rm_model"
DPO_STATE = "dpo_state"


def train_stage(
    run_dir: Path,
    model,
    tokenizer,
    objective,
    s: Schedule,
    *,
    state: str,
    evaluate: Callable[[], dict],
    eval_every: int,
    fresh: bool,
    console,
    title: str,
    row: Callable[[dict], dict] = dict,
    info: Callable[[dict], str] = lambda m: f"loss {m['loss']:.3f}",
    keep: dict | None = None,
) -> dict:
    """Run ``objective`` under the offline loop with a checkpoint in ``RUN_DIR/<state>``; returns
    ``ends`` (the held-out metrics at the start and the end, as summary keys) and ``losses`` (every
    step's). ``row(metrics)`` is what a step records; ``evaluate()``'s metrics join it every
    ``eval_every`` steps and at the last."""
    console = console or Console(False)
    recorder = Recorder(run_dir)
    saved = None if fresh else saved_state(run_dir / state)
    first, last = saved["first"] if saved else evaluate(), {}  # a resume keeps the start's
    keep = {**(keep or {}), "first": first}
    if fresh:
        recorder.record(0, {k: v for k, v in first.items() if v is not None})
    task = console.task(title, s.steps)
    held = ""

    def on_step(step: int, m: dict[str, float]) -> None:
        nonlocal held, last
        out = row(m)
        if step == s.steps or (eval_every and step % eval_every == 0):
            last = evaluate()
            out |= {k: v for k, v in last.items() if v is not None}
            acc = next((k for k in last if "accuracy" in k and last[k] is not None), None)
            held = f" | held-out acc {last[acc]:.1%}" if acc else ""
        recorder.record(step, out)
        console.advance(task, info(m) + held)

    try:
        losses = train_offline(
            model,
            objective,
            s,
            state_dir=run_dir / state,
            tokenizer=tokenizer,
            stop=stop_requested,
            on_step=on_step,
            keep=keep,
        )
    finally:
        recorder.close()
    console.done(task)
    last = last or evaluate()  # a resume of a finished run takes no step
    ends = {f"{k}_start": v for k, v in first.items()} | {f"{k}_end": v for k, v in last.items()}
    return {"ends": ends, "losses": losses}


def _finished(out: Path) -> bool:
    if (out / "config.json").is_file():
        print(f"rlpost: {out} is already trained", file=sys.stderr)
        return True
    return False


def _threads(run: Callable) -> Callable:
    """``run`` with torch's threads as ``run.threads`` says, restored after."""

    def wrapped(cfg: Config, *args, **kw):
        threads = torch.get_num_threads()
        torch.set_num_threads(pick_threads(cfg.run.threads))
        try:
            return run(cfg, *args, **kw)
        finally:
            torch.set_num_threads(threads)

    return wrapped


def _finish(run_dir: Path, model, tokenizer, out: Path, state: str, summary: dict) -> None:
    """Write the summary, then the model to ``out`` (its checkpoints in ``state`` go)."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    model.to("cpu")
    save_model(model, tokenizer, out, state_dir=run_dir / state)


CHAT_ARITH_SIZES = (400, 40)  # (train, held-out) conversations of sft.data=chat_arith


def load_conversations(cfg: Config) -> tuple[list[Conversation], list[Conversation], dict]:
    """(train, held-out, {split: LoadReport}) as ``sft.data`` says."""
    s, seed = cfg.sft, cfg.run.seed
    if s.data == "chat_arith":
        n, held = CHAT_ARITH_SIZES
        convs = chat_arith(n + held, seed=0)  # a fixed set, whatever the run seed
        return convs[:n], convs[n:], {"train": LoadReport(rows=n), "eval": LoadReport(rows=held)}
    kw = dict(
        messages_field=s.messages_field, answer_field=s.answer_field, on_bad_row=cfg.data.on_bad_row
    )
    train, report = load_conversation_file(s.train_path, **kw)
    reports = {"train": report}
    if s.eval_path:
        held, reports["eval"] = load_conversation_file(s.eval_path, **kw)
    elif s.eval_fraction > 0 and len(train) > 1:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
        n_eval = min(max(1, round(s.eval_fraction * len(train))), len(train) - 1)
        held = [train[i] for i in sorted(order[:n_eval])]
        train = [train[i] for i in sorted(order[n_eval:])]
    else:
        held = []
    return train, held, reports


def accuracy(model, tokenizer, convs: list[Conversation], max_new_tokens: int) -> float | None:
    """Share of the held-out conversations with a reference answer whose greedy last reply matches
    it (numerically when the answer is a number, else as a string); None: no row has an answer."""
    rows = [c for c in convs if c.answer is not None]
    if not rows:
        return None
    prompts = [prompt_for_answer(c, tokenizer) for c in rows]
    replies = greedy_replies(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    hits = 0.0
    for c, p, reply in zip(rows, prompts, replies, strict=True):
        sample = RewardSample(prompt=p, completion=reply, answer=c.answer)
        score = numeric_match(sample)
        hits += score if score is not None else (exact_match(sample) or 0.0)
    return hits / len(rows)


def conversation_rows(cfg: Config, model, tokenizer):
    """(train examples, held-out examples, held-out conversations, reports, whether a chat
    template was added) of ``sft.data``, encoded for ``tokenizer``."""
    s = cfg.sft
    train_convs, held_convs, reports = load_conversations(cfg)
    templated = ensure_chat_template(tokenizer)
    context = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    enc = dict(
        last_turn_only=s.last_turn_only,
        max_len=s.max_seq_len or context,
        on_bad_row=cfg.data.on_bad_row,
    )
    train = encode_conversations(train_convs, tokenizer, report=reports["train"], **enc)
    eval_report = reports.get("eval", LoadReport())
    held = encode_conversations(held_convs, tokenizer, report=eval_report, **enc)
    if not train:
        raise DataError("no conversation to train on")
    return train, held, held_convs, reports, templated


def _example(prompt: Prompt, rng):
    return prompt.metadata["example"]


def run_conversation_sft(cfg: Config, resume: Path | None = None, console=None) -> Path:
    """Train on conversations; returns ``RUN_DIR/sft_model``."""
    started, s = time.time(), cfg.sft
    model, tokenizer = build.build_policy(cfg)
    train, held, held_convs, reports, templated = conversation_rows(cfg, model, tokenizer)
    run_dir = open_stage_run_dir(cfg, resume, SFT_STATE)
    report_data(run_dir, reports, fresh=resume is None)
    out = run_dir / "sft_model"
    if _finished(out):
        return out
    on_run_device(cfg, model)
    budget = dict(max_tokens=s.max_tokens_per_micro_batch, max_rows=s.batch_size)
    pad = tokenizer.pad_token_id

    def held_out() -> dict:
        return {
            "eval_loss": mean_nll(model, held, pad, **budget),
            "eval_accuracy": accuracy(model, tokenizer, held_convs, s.eval_max_tokens),
        }

    prompts = [Prompt(text="", metadata={"example": e}, uid=e.text) for e in train]
    device, cap = model_device(model), s.max_tokens_per_micro_batch
    objective = SFT(tokenizer, prompts, example=_example, max_tokens=cap, device=device)
    done = train_stage(
        run_dir,
        model,
        tokenizer,
        objective,
        schedule(s, cfg.run.seed),
        state=SFT_STATE,
        evaluate=held_out,
        eval_every=s.eval_every,
        fresh=resume is None,
        console=console,
        title="sft on conversations",
        row=lambda m: {"sft_loss": m["loss"]},
    )
    losses = done["losses"]
    (run_dir / "sft_losses.json").write_text(json.dumps(losses))
    _finish(
        run_dir,
        model,
        tokenizer,
        out,
        SFT_STATE,
        {
            **done["ends"],
            "sft_loss_last": losses[-1] if losses else None,
            "steps": s.steps,
            "train_examples": len(train),
            "eval_examples": len(held),
            "chat_template": "plain (added)" if templated else "the tokenizer's",
            "wall_seconds": time.time() - started,
            **data_counts(reports),
        },
    )
    return out


def rm_rows(cfg: Config, s: RMConfig):
    """(reward model, tokenizer, encoded train pairs, held-out pairs, load reports)."""
    train_pairs, held_pairs, reports = load_pairs_reported(
        cfg.data, cfg.run.seed, margin_field=s.margin_field
    )
    lm, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed
    )
    max_len = getattr(lm.config, "max_position_embeddings", None) or tokenizer.model_max_length
    model = reward_model_from(lm, tokenizer.pad_token_id, seed=cfg.run.seed)
    enc = dict(max_len=max_len, on_bad_row=cfg.data.on_bad_row)
    train = encode_rm_pairs(train_pairs, tokenizer, report=reports["train"], **enc)
    held = encode_rm_pairs(held_pairs, tokenizer, report=reports["eval"], **enc)
    if not len(train) or not len(held):
        raise DataError(f"no {'training' if not len(train) else 'held-out'} pair fits the model")
    return model, tokenizer, train, held, reports


@_threads
def run_rm(cfg: Config, resume: Path | None = None, console=None) -> Path:
    """Train the reward model; returns ``RUN_DIR/rm_model`` (the ``reward_model`` reward's
    ``path``)."""
    started, s = time.time(), cfg.rm or RMConfig()
    # Inputs first: a start that fails on them leaves an existing run untouched.
    model, tokenizer, train, held, reports = rm_rows(cfg, s)
    run_dir = open_stage_run_dir(cfg, resume, RM_STATE)
    report_data(run_dir, reports, fresh=resume is None)
    out = run_dir / RM_MODEL
    if _finished(out):
        return out
    on_run_device(cfg, model)
    pad = tokenizer.pad_token_id
    done = train_stage(
        run_dir,
        model,
        tokenizer,
        BradleyTerry(train, pad, s.micro_batch_size),
        schedule(s, cfg.run.seed),
        state=RM_STATE,
        evaluate=lambda: evaluate_rm(model, held, pad),
        eval_every=s.eval_every,
        fresh=resume is None,
        console=console,
        title="reward model (bradley-terry)",
        info=lambda m: f"loss {m['loss']:.3f} | acc {m['accuracy']:.1%}",
    )
    # The reward worker reads the score at the last non-pad token through this id, and
    # pads as the tokenizer says: right, as trained (left padding would shift positions).
    model.config.pad_token_id = pad
    tokenizer.padding_side = "right"
    _finish(
        run_dir,
        model,
        tokenizer,
        out,
        RM_STATE,
        {
            **done["ends"],
            "train_loss_last": done["losses"][-1],
            "steps": s.steps,
            "train_pairs": len(train),
            "eval_pairs": len(held),
            "margin_field": s.margin_field,
            "started_from": cfg.model.path or "the tiny model config",
            "wall_seconds": time.time() - started,
            **data_counts(reports),
        },
    )
    return out


@_threads
def run_dpo(cfg: Config, resume: Path | None = None, console=None) -> DPOResult:
    """Warm up on the chosen responses, store the reference log-probs, train with DPO / IPO;
    the policy is ``RUN_DIR/model``, the held-out metrics before and after in the summary."""
    started, s = time.time(), cfg.dpo or DPOConfig()
    rules.check(cfg, "dpo")
    torch.manual_seed(cfg.run.seed)
    # Inputs first: a start that fails on them leaves an existing run untouched.
    train_pairs, eval_pairs, counts = load_pairs(cfg.data, cfg.run.seed)
    model, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed
    )
    if resume is None:
        run_dir = prepare_run_dir(cfg, None, prompts=False)[0]
    else:
        run_dir = open_stage_run_dir(cfg, resume, DPO_STATE)
    pad = tokenizer.pad_token_id
    train_set, eval_set = (encode_pairs(p, tokenizer) for p in (train_pairs, eval_pairs))
    keep = saved_state(run_dir / DPO_STATE) if resume is not None else None
    console = console or Console(cfg.observe.progress)
    if keep is None:  # the reference is the policy after the warm-up, before any DPO step
        keep = {"sft_loss_last": _warm_up_on_chosen(cfg, model, tokenizer, train_pairs, console)}
        for pairs in (train_set, eval_set):
            attach_reference(model, pairs, pad, chunk=256)
        keep["ref"] = [t for p in (train_set, eval_set) for t in (p.ref_chosen, p.ref_rejected)]
    train_set.ref_chosen, train_set.ref_rejected = keep["ref"][:2]
    eval_set.ref_chosen, eval_set.ref_rejected = keep["ref"][2:]
    kw = s.loss_kwargs()
    done = train_stage(
        run_dir,
        model,
        tokenizer,
        DPO(train_set, pad, s.micro_batch_size, kw),
        schedule(s, cfg.run.seed),
        state=DPO_STATE,
        evaluate=lambda: evaluate_pairs(model, eval_set, pad, kw),
        eval_every=s.eval_every,
        fresh=resume is None,
        console=console,
        title=f"dpo ({s.loss_type})",
        keep=keep,
        info=lambda m: f"loss {m['loss']:.3f} | margin {m['reward_margin']:.3f}",
    )
    summary = {
        **done["ends"],
        "eval_pairs": len(eval_set),
        "train_pairs": len(train_set),
        "steps": s.steps,
        "loss_type": s.loss_type,
        "beta": s.beta,
        "sft_loss_last": keep["sft_loss_last"],
        "wall_seconds": time.time() - started,
        **counts,
    }
    _finish(run_dir, model, tokenizer, run_dir / "model", DPO_STATE, summary)
    if cfg.observe.progress:
        _print_summary(summary, run_dir)
    return DPOResult(run_dir, summary)


def _warm_up_on_chosen(cfg: Config, model, tokenizer, pairs, console) -> float | None:
    """SFT on each pair's chosen response (``sft`` section); the last step's loss."""
    if cfg.sft.steps == 0:
        return None
    task = console.task("sft on chosen", cfg.sft.steps)
    sft = SFT(tokenizer, [Prompt(text=p.prompt, answer=p.chosen) for p in pairs])
    losses = train_offline(
        model,
        sft,
        schedule(cfg.sft, cfg.run.seed),
        on_step=lambda i, m: console.advance(task, f"loss {m['loss']:.3f}"),
    )
    console.done(task)
    return losses[-1]


@dataclass
class DPOResult:
    run_dir: Path
    summary: dict[str, Any]


# Held-out metrics reported before and after training: (key, table label, format).
SUMMARY_ROWS = (
    ("eval_pref_accuracy", "preference accuracy (implicit reward)", ".1%"),
    ("eval_margin", "reward margin", ".3f"),
    ("eval_logp_accuracy", "log p(chosen) > log p(rejected)", ".1%"),
)


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
