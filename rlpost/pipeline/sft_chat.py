"""``rlpost sft`` on conversations, top to bottom.

    conversation rows --check--> chat template + assistant mask --> examples
        --sft steps (token-budget micro-batches)--> RUN_DIR/sft_model
    held-out conversations --> loss, and greedy accuracy where rows give an answer

The run reads the one config tree (``sft.data`` picks the conversations; ``data.on_bad_row``
decides what a bad row does; ``model`` is the starting checkpoint). Bad rows are reported
as a run's are: on the console and in ``RUN_DIR/data_report.json`` with file and line. The
steps are :func:`rlpost.train.sft.sft_train`'s, so a stopped or killed run resumes from
``RUN_DIR/sft_state`` exactly as the warm-up of ``rlpost train`` does. The output,
``RUN_DIR/sft_model``, is an ordinary checkpoint for ``model.path`` (with the chat template
it was trained with).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from rlpost.config import Config, ConfigError
from rlpost.data.conversations import (
    Conversation,
    chat_arith,
    encode_conversations,
    ensure_chat_template,
    load_conversation_file,
    prompt_for_answer,
)
from rlpost.data.files import DataError, LoadReport
from rlpost.observe import Recorder
from rlpost.pipeline import build
from rlpost.pipeline.interrupts import stop_requested
from rlpost.pipeline.preflight import data_counts, report_data
from rlpost.pipeline.rundir import SFT_STATE, open_stage_run_dir, schedule
from rlpost.rewards.verifiable import exact_match, numeric_match
from rlpost.train.sft import save_model, sft_train
from rlpost.train.sft_chat import greedy_replies, mean_nll
from rlpost.types import Prompt, RewardSample

CHAT_ARITH_SIZES = (400, 40)  # (train, held-out) conversations of sft.data=chat_arith


def load_conversations(cfg: Config) -> tuple[list[Conversation], list[Conversation], dict]:
    """(train, held-out, {split: LoadReport}) as ``sft.data`` says."""
    s, seed = cfg.sft, cfg.run.seed
    if s.data == "chat_arith":
        convs = chat_arith(sum(CHAT_ARITH_SIZES), seed=0)  # a fixed set, whatever the run seed
        n = CHAT_ARITH_SIZES[0]
        return (
            convs[:n],
            convs[n:],
            {"train": LoadReport(rows=n), "eval": LoadReport(rows=len(convs) - n)},
        )
    if s.data != "file" or not s.train_path:
        raise ConfigError("sft.data=file needs sft.train_path; set it to a JSONL or Parquet file")
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
    """Share of the held-out conversations with a reference answer whose greedy last reply
    matches it (numerically when the answer is a number, else as a string); None: no row
    has an answer."""
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


def run_conversation_sft(cfg: Config, resume: Path | None = None, console=None) -> Path:
    """Train on conversations; returns ``RUN_DIR/sft_model``. Stopped (Ctrl-C): the state is
    saved and :class:`~rlpost.train.sft.WarmupInterrupted` propagates."""
    started, s = time.time(), cfg.sft
    train_convs, held_convs, reports = load_conversations(cfg)
    model, tokenizer = build.build_policy(cfg)
    templated = ensure_chat_template(tokenizer)
    context = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    max_len = s.max_seq_len or context
    enc = dict(last_turn_only=s.last_turn_only, max_len=max_len, on_bad_row=cfg.data.on_bad_row)
    train = encode_conversations(train_convs, tokenizer, report=reports["train"], **enc)
    held = encode_conversations(
        held_convs, tokenizer, report=reports.get("eval", LoadReport()), **enc
    )
    if not train:
        raise DataError("no conversation to train on")
    run_dir = open_stage_run_dir(cfg, resume, SFT_STATE)
    report_data(run_dir, reports, fresh=resume is None)
    out = run_dir / "sft_model"
    if (out / "config.json").is_file():
        print(f"rlpost: {out} is already trained", file=sys.stderr)
        return out
    budget = dict(max_tokens=s.max_tokens_per_micro_batch, max_rows=s.batch_size)
    pad = tokenizer.pad_token_id
    if cfg.run.device != "cpu" and torch.cuda.is_available():
        model.to("cuda")
    recorder = Recorder(run_dir)

    def held_out() -> dict:
        return {
            "eval_loss": mean_nll(model, held, pad, **budget),
            "eval_accuracy": accuracy(model, tokenizer, held_convs, s.eval_max_tokens),
        }

    first, last = held_out(), {}
    if resume is None:
        recorder.record(0, {k: v for k, v in first.items() if v is not None})

    def on_step(step: int, loss: float) -> None:
        row = {"sft_loss": loss}
        if step + 1 == s.steps:  # the final evaluation, in the last step's row
            last.update(held_out())
            row |= {k: v for k, v in last.items() if v is not None}
        elif s.eval_every and (step + 1) % s.eval_every == 0:
            row["eval_loss"] = mean_nll(model, held, pad, **budget)
        recorder.record(step + 1, row)
        if console is not None:
            console.advance(task, f"loss {loss:.3f}")

    task = console.task("sft on conversations", s.steps) if console is not None else None
    prompts = [Prompt(text="", metadata={"example": e}, uid=e.text) for e in train]
    try:
        losses = sft_train(
            model,
            tokenizer,
            prompts,
            **schedule(s, cfg.run.seed),
            on_step=on_step,
            state_dir=run_dir / SFT_STATE,
            stop=stop_requested,
            example=lambda p, rng: p.metadata["example"],
            save_every=s.save_every,
            max_tokens_per_micro_batch=s.max_tokens_per_micro_batch,
        )
    finally:
        recorder.close()
    if console is not None:
        console.done(task)
    last = last or held_out()  # a resume of a finished run takes no step
    summary = {
        **{f"{k}_start": v for k, v in first.items()},
        **{f"{k}_end": v for k, v in last.items()},
        "sft_loss_last": losses[-1] if losses else None,
        "steps": s.steps,
        "train_examples": len(train),
        "eval_examples": len(held),
        "chat_template": "plain (added)" if templated else "the tokenizer's",
        "wall_seconds": time.time() - started,
        **data_counts(reports),
    }
    (run_dir / "sft_losses.json").write_text(json.dumps(losses))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    model.to("cpu")
    save_model(model, tokenizer, out, state_dir=run_dir / SFT_STATE)
    return out
