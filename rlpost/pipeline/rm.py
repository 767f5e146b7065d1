"""``rlpost rm``: reward-model training on preference pairs, top to bottom.

    pairs (built-in task or file) --check--> token ids as the reward model reads them
    model.path (a causal LM, e.g. a run's sft_model; None: the tiny model)
        --backbone + new score head--> sequence classifier
        --Bradley-Terry steps--> RUN_DIR/rm_model (the ``reward_model`` reward's ``path``)
    held-out pairs --> pairwise accuracy and loss, at the start, every rm.eval_every, the end

The run reads the one config tree (``run``, ``model``, ``data``, ``rm``, ``observe``).
Bad rows of a pairs file are reported as a run's are: on the console and in
``RUN_DIR/data_report.json`` with file and line. A stopped or killed run resumes from
``RUN_DIR/rm_state`` (``--resume RUN_DIR``) and takes the same steps as one that never
stopped. The model, the steps and the loss are :mod:`rlpost.train.reward_model`'s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from rlpost.config import Config
from rlpost.data.files import DataError
from rlpost.data.preferences import load_pairs_reported
from rlpost.models.loading import load_policy
from rlpost.observe import Recorder
from rlpost.observe.mfu import pick_threads
from rlpost.pipeline.interrupts import stop_requested
from rlpost.pipeline.preflight import data_counts, report_data
from rlpost.pipeline.rundir import open_stage_run_dir, schedule
from rlpost.train.reward_model import encode_pairs, evaluate_rm, reward_model_from, rm_train
from rlpost.train.sft import save_model

RM_STATE = "rm_state"
RM_MODEL = "rm_model"


def run_rm(cfg: Config, resume: Path | None = None, console=None) -> Path:
    """Train the reward model; returns ``RUN_DIR/rm_model``. Stopped (Ctrl-C): the state is
    saved and :class:`~rlpost.train.sft.WarmupInterrupted` propagates."""
    threads = torch.get_num_threads()
    torch.set_num_threads(pick_threads(cfg.run.threads))
    try:
        return _run(cfg, resume, console)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: Config, resume: Path | None, console) -> Path:
    started, s = time.time(), cfg.rm
    # Inputs first: a start that fails on them leaves an existing run untouched.
    train_pairs, held_pairs, reports = load_pairs_reported(
        cfg.data, cfg.run.seed, margin_field=s.margin_field
    )
    lm, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed
    )
    max_len = getattr(lm.config, "max_position_embeddings", None) or tokenizer.model_max_length
    model = reward_model_from(lm, tokenizer.pad_token_id, seed=cfg.run.seed)
    del lm
    enc = dict(max_len=max_len, on_bad_row=cfg.data.on_bad_row)
    train = encode_pairs(train_pairs, tokenizer, report=reports["train"], **enc)
    held = encode_pairs(held_pairs, tokenizer, report=reports["eval"], **enc)
    if not len(train) or not len(held):
        raise DataError(f"no {'training' if not len(train) else 'held-out'} pair fits the model")
    run_dir = open_stage_run_dir(cfg, resume, RM_STATE)
    report_data(run_dir, reports, fresh=resume is None)
    out = run_dir / RM_MODEL
    if (out / "config.json").is_file():
        print(f"rlpost: {out} is already trained", file=sys.stderr)
        return out
    if cfg.run.device != "cpu" and torch.cuda.is_available():
        model.to("cuda")
    pad = tokenizer.pad_token_id
    recorder = Recorder(run_dir)
    first = evaluate_rm(model, held, pad)
    if resume is None:
        recorder.record(0, first)
    task = console.task("reward model (bradley-terry)", s.steps) if console else None
    held_info, last = "", {}

    def on_step(step: int, m: dict[str, float]) -> None:
        nonlocal held_info, last
        if step == s.steps or (s.eval_every and step % s.eval_every == 0):
            last = evaluate_rm(model, held, pad)
            m = {**m, **last}
            held_info = f" | held-out acc {m['eval_accuracy']:.1%}"
        recorder.record(step, m)
        if console is not None:
            console.advance(task, f"loss {m['loss']:.3f} | acc {m['accuracy']:.1%}{held_info}")

    try:
        losses = rm_train(
            model,
            train,
            pad,
            **schedule(s, cfg.run.seed),
            micro_batch_size=s.micro_batch_size,
            on_step=on_step,
            state_dir=run_dir / RM_STATE,
            stop=stop_requested,
            save_every=s.save_every,
        )
    finally:
        recorder.close()
    if console is not None:
        console.done(task)
    last = last or evaluate_rm(model, held, pad)  # every step ran before a resume
    summary = {
        **{f"{k}_start": v for k, v in first.items()},
        **{f"{k}_end": v for k, v in last.items()},
        "train_loss_last": losses[-1],
        "steps": s.steps,
        "train_pairs": len(train),
        "eval_pairs": len(held),
        "margin_field": s.margin_field,
        "started_from": cfg.model.path or "the tiny model config",
        "wall_seconds": time.time() - started,
        **data_counts(reports),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    model.to("cpu")
    # The reward worker reads the score at the last non-pad token through this id, and
    # pads as the tokenizer says: right, as trained (left padding would shift positions).
    model.config.pad_token_id = pad
    tokenizer.padding_side = "right"
    save_model(model, tokenizer, out, state_dir=run_dir / RM_STATE)
    return out
