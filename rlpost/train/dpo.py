"""Offline preference optimisation (DPO / IPO) on preference pairs, top to bottom.

    pairs --sft on chosen--> starting policy --frozen copy--> reference log-probs (once)
          --dpo steps--> policy --held-out pairs--> preference accuracy before / after

Simplifications, on purpose: the reference model is never kept in memory;
its summed sequence log-probs for every train and held-out pair are computed
once, before the first update, with the starting policy. Chosen and rejected
responses of a micro-batch go through the model in one forward pass. The loss
math is :func:`rlpost.algos.dpo.dpo_loss`; this module only feeds it.

The held-out preference accuracy counts pairs whose implicit reward of the
chosen response beats the rejected one (policy margin > reference margin); a
tie, which is every pair before training, counts one half, the accuracy of a
coin flip, so the starting value is 50% rather than a meaningless 0%.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import Field, ValidationError, model_validator
from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rlpost.algos.aggregate import masked_sum
from rlpost.algos.dpo import dpo_loss
from rlpost.config import (
    ConfigError,
    Section,
    TinyModelConfig,
    format_validation_error,
    merge,
    parse_overrides,
    read_recipe,
)
from rlpost.data.preferences import PrefDataConfig, PreferencePair, load_pairs
from rlpost.data.sampler import PromptSampler
from rlpost.models.loading import load_policy
from rlpost.observe import Recorder
from rlpost.train.batch import (
    TrainBatch,
    collate,
    compute_logprobs,
    response_logits,
    token_logprobs,
)
from rlpost.train.checkpoint import claim_run_dir
from rlpost.train.sft import sft_train, warmup_then_cosine
from rlpost.types import Completion, Prompt

# ------------------------------------------------------------------------ config


class DPORunConfig(Section):
    output_dir: str = "runs"
    """Parent directory of run directories."""
    name: str = "dpo_prefs"
    """Run name; the run directory is ``output_dir/name``."""
    overwrite: bool = False
    """Replace an existing run directory of the same name (its files are deleted); without it
    an existing run directory is refused (``--overwrite`` on the command line sets it)."""
    seed: int = 0
    """Seed for initialisation and pair order."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads (0: leave torch's default). One suits the tiny model on a busy CPU."""


class DPOModelConfig(Section):
    path: str | None = None
    """Local directory of a Hugging Face causal LM and its tokenizer. None: the built-in tiny model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the built-in tiny model (used when path is None)."""


class DPOSFTConfig(Section):
    """Supervised warm-up on the chosen responses of the training pairs."""

    steps: int = Field(200, ge=0)
    """Optimizer steps of warm-up (0: none; the starting policy is model.path as loaded)."""
    lr: float = Field(3e-3, gt=0.0)
    """Peak learning rate."""
    batch_size: int = Field(64, ge=1)
    """Sequences per step."""
    warmup_steps: int = Field(10, ge=0)
    """Linear LR warm-up steps."""


class DPOSection(Section):
    beta: float = Field(0.1, gt=0.0)
    """Strength of the implicit KL to the reference (DPO beta; IPO's margin is 1/(2 beta))."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (arXiv 2305.18290); ipo: IPO's squared loss (arXiv 2310.12036)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """Assumed rate of flipped labels (conservative DPO); sigmoid loss only."""
    lr: float = Field(5e-4, gt=0.0)
    """Peak learning rate (linear warm-up, then cosine decay to a tenth of it)."""
    steps: int = Field(400, ge=0)
    """Optimizer steps."""
    batch_size: int = Field(64, ge=1)
    """Pairs per optimizer step."""
    micro_batch_size: int = Field(64, ge=1)
    """Pairs per forward/backward pass (gradient accumulation inside a step)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear LR warm-up, in optimizer steps."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip."""
    eval_every: int = Field(50, ge=0)
    """Evaluate on the held-out pairs every N steps (0: only at start and end)."""

    @model_validator(mode="after")
    def _consistent(self) -> DPOSection:
        if self.micro_batch_size > self.batch_size:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} is larger than "
                f"batch_size={self.batch_size}; set micro_batch_size <= batch_size"
            )
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ValueError(
                f"label_smoothing={self.label_smoothing} has no effect with loss_type=ipo; "
                "set it to 0 or use loss_type=sigmoid"
            )
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`rlpost.algos.dpo.dpo_loss` this section sets."""
        return {
            "beta": self.beta,
            "loss_type": self.loss_type,
            "label_smoothing": self.label_smoothing,
        }


class DPOObserveConfig(Section):
    progress: bool = True
    """Show a live progress bar and the before/after table."""


class DPOConfig(Section):
    run: DPORunConfig = DPORunConfig()
    model: DPOModelConfig = DPOModelConfig()
    data: PrefDataConfig = PrefDataConfig()
    sft: DPOSFTConfig = DPOSFTConfig()
    dpo: DPOSection = DPOSection()
    observe: DPOObserveConfig = DPOObserveConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> DPOConfig:
        """Load a recipe (None: defaults), apply dotted overrides, validate; raises ConfigError."""
        data = read_recipe(path) if path is not None else {}
        data = merge(data, parse_overrides(overrides or [], cls))
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, cls)) from None


# ----------------------------------------------------------------- pair tensors


@dataclass
class PairSet:
    """Tokenised pairs: ``chosen[i]`` and ``rejected[i]`` answer the same prompt.

    ``ref_chosen`` / ``ref_rejected``: ``[N]`` float32 summed log-probs under the
    frozen starting policy, filled once by :func:`attach_reference`.
    """

    chosen: list[Completion]
    rejected: list[Completion]
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.chosen)


def encode_pairs(pairs: list[PreferencePair], tokenizer) -> PairSet:
    """Tokenise prompts and responses; each response ends with EOS, as the policy would stop."""

    def completion(prompt_ids: list[int], text: str, i: int) -> Completion:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return Completion(prompt_ids, ids, [0.0] * len(ids), "stop", 0, i)

    chosen, rejected = [], []
    for i, pair in enumerate(pairs):
        prompt_ids = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]
        chosen.append(completion(prompt_ids, pair.chosen, i))
        rejected.append(completion(prompt_ids, pair.rejected, i))
    return PairSet(chosen, rejected)


def pair_batch(pairs: PairSet, idx: list[int], pad_id: int) -> TrainBatch:
    """Rows ``0..n-1`` are the chosen responses of pairs ``idx``, rows ``n..2n-1`` the rejected."""
    rows = [pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx]
    return collate(rows, [0.0] * len(rows), pad_id)


def sequence_logprobs(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """Summed response log-probs ``[B]`` (with gradient): sum_t log pi(y_t | x, y_<t)."""
    logprobs = token_logprobs(response_logits(model, batch), batch.responses)
    return masked_sum(logprobs, batch.response_mask, dim=-1)


@torch.no_grad()
def pair_logprobs(
    model: torch.nn.Module, pairs: PairSet, pad_id: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen ``[N]``, rejected ``[N]``) summed log-probs under ``model``, no gradient.

    The chunking is a pure function of ``chunk``, so the same model gives
    bit-identical values every call (the policy ties the reference at step 0).
    """
    chosen, rejected = [], []
    for lo in range(0, len(pairs), chunk):
        idx = list(range(lo, min(lo + chunk, len(pairs))))
        batch = pair_batch(pairs, idx, pad_id)
        lp = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=2 * len(idx))
        seq = masked_sum(lp, batch.response_mask, dim=-1)
        chosen.append(seq[: len(idx)])
        rejected.append(seq[len(idx) :])
    return torch.cat(chosen), torch.cat(rejected)


def attach_reference(model: torch.nn.Module, pairs: PairSet, pad_id: int, chunk: int) -> None:
    """Fill ``pairs.ref_chosen`` / ``ref_rejected`` from the (frozen, starting) ``model``."""
    pairs.ref_chosen, pairs.ref_rejected = pair_logprobs(model, pairs, pad_id, chunk)


def _tie_half(x: torch.Tensor) -> float:
    """Mean of ``1[x > 0] + 0.5 * 1[x == 0]`` over ``x [N]``."""
    return float(((x > 0).float() + 0.5 * (x == 0).float()).mean())


def evaluate_pairs(
    model: torch.nn.Module, pairs: PairSet, pad_id: int, s: DPOSection, chunk: int = 256
) -> dict[str, float]:
    """Held-out preference metrics of ``model`` against the stored reference log-probs.

    ``eval_pref_accuracy``: pairs with implicit reward chosen > rejected (ties
    half); ``eval_margin``: mean ``beta h``; ``eval_logp_accuracy``: pairs where
    the policy itself gives the chosen response the higher log-prob (ties half).
    """
    pc, pr = pair_logprobs(model, pairs, pad_id, chunk)
    out = dpo_loss(pc, pr, pairs.ref_chosen, pairs.ref_rejected, **s.loss_kwargs())
    h = (pc - pairs.ref_chosen) - (pr - pairs.ref_rejected)
    return {
        "eval_pref_accuracy": _tie_half(h),
        "eval_margin": float(out.stats["reward_margin"]),
        "eval_loss": float(out.loss),
        "eval_logp_accuracy": _tie_half(pc - pr),
        "eval_chosen_logp": float(pc.mean()),
        "eval_rejected_logp": float(pr.mean()),
    }


# ------------------------------------------------------------------------ update


def dpo_update(
    model: torch.nn.Module,
    optimizer,
    scheduler,
    pairs: PairSet,
    idx: list[int],
    pad_id: int,
    s: DPOSection,
) -> dict[str, float]:
    """One optimizer step on pairs ``idx``, accumulated over micro-batches of pairs.

    Each micro-batch loss is divided by ``len(idx)`` (``num_pairs``), so the
    summed gradient equals the whole batch's whatever the micro-batch size. A
    non-finite loss or gradient skips the step (``skipped`` = 1).
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    acc: dict[str, float] = {"loss": 0.0}
    for lo in range(0, len(idx), s.micro_batch_size):
        part = idx[lo : lo + s.micro_batch_size]
        seq = sequence_logprobs(model, pair_batch(pairs, part, pad_id))
        rows = torch.tensor(part)
        chosen, rejected = seq[: len(part)], seq[len(part) :]
        ref_c, ref_r = pairs.ref_chosen[rows], pairs.ref_rejected[rows]
        out = dpo_loss(chosen, rejected, ref_c, ref_r, **s.loss_kwargs(), num_pairs=len(idx))
        out.loss.backward()
        acc["loss"] += float(out.loss.detach())
        for key, value in out.stats.items():
            acc[key] = acc.get(key, 0.0) + float(value) * len(part) / len(idx)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip))
    acc["grad_norm"] = grad_norm
    acc["lr"] = optimizer.param_groups[0]["lr"]
    if not (math.isfinite(acc["loss"]) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        acc["skipped"] = 1.0
        return acc
    optimizer.step()
    scheduler.step()
    acc["skipped"] = 0.0
    return acc


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


def _prepare_run_dir(cfg: DPOConfig) -> Path:
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    return claim_run_dir(cfg.run_dir, overwrite=cfg.run.overwrite, config_text=text)


def _progress(enabled: bool) -> Progress:
    columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(
        TextColumn("[bold]{task.description}"),
        *columns,
        TextColumn("{task.fields[info]}"),
        console=RichConsole(stderr=True),
        disable=not enabled,
    )


def _warm_up(cfg: DPOConfig, model, tokenizer, train: list[PreferencePair], bar) -> list[float]:
    s = cfg.sft
    if s.steps == 0:
        return []
    task = bar.add_task("sft on chosen", total=s.steps, info="")
    prompts = [Prompt(text=p.prompt, answer=p.chosen) for p in train]
    return sft_train(
        model,
        tokenizer,
        prompts,
        steps=s.steps,
        lr=s.lr,
        batch_size=s.batch_size,
        warmup_steps=s.warmup_steps,
        seed=cfg.run.seed,
        on_step=lambda i, loss: bar.update(task, advance=1, info=f"loss {loss:.3f}"),
    )


def run_dpo(cfg: DPOConfig) -> DPOResult:
    """Warm up, store reference log-probs, train with DPO / IPO, report held-out preference."""
    started = time.time()
    torch.manual_seed(cfg.run.seed)
    threads = torch.get_num_threads()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    try:
        return _run(cfg, started)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DPOConfig, started: float) -> DPOResult:
    # Inputs first: a start that fails on them leaves an existing run untouched.
    train_pairs, eval_pairs, counts = load_pairs(cfg.data, cfg.run.seed)
    model, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed
    )
    run_dir = _prepare_run_dir(cfg)
    pad_id, s = tokenizer.pad_token_id, cfg.dpo
    recorder = Recorder(run_dir)
    bar = _progress(cfg.observe.progress)
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


def _train(model, train_set, eval_set, pad_id, cfg: DPOConfig, recorder, bar) -> dict[str, float]:
    """The DPO steps; returns the final held-out metrics."""
    s = cfg.dpo
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_then_cosine(s.warmup_steps, s.steps)
    )
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
