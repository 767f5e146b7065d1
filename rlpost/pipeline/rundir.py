"""The run directory: resolved config in, starting policy, summary and plot out.

RUN_DIR/config.yaml        the resolved config (what actually ran)
RUN_DIR/sft_model/         the warm-up policy (an HF checkpoint) when SFT ran
RUN_DIR/sft_state/         an interrupted warm-up's checkpoints (gone once the warm-up finishes)
RUN_DIR/data_report.json   rows used and skipped by reason, every skipped row with file and line
RUN_DIR/metrics.jsonl      one line per step
RUN_DIR/checkpoints/       resumable checkpoints
RUN_DIR/summary.json       eval accuracy before / after, steps, wall seconds
RUN_DIR/curves.png         reward and held-out accuracy against steps
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlpost.config import Config, ConfigError, dump_config
from rlpost.models.loading import ModelLoadError, load_causal_lm
from rlpost.observe.recorder import METRICS_FILE
from rlpost.pipeline import build
from rlpost.pipeline.interrupts import stop_requested
from rlpost.pipeline.preflight import check_inputs, read_data_counts, report_data
from rlpost.statefile import atomic_write
from rlpost.train.batch import model_device
from rlpost.train.checkpoint import claim_run_dir, latest_step, usable_checkpoint
from rlpost.train.offline import Schedule, save_model, steps_done, train_offline
from rlpost.train.sft import SFT

SFT_STATE = "sft_state"


def prepare_run_dir(
    cfg: Config, resume: Path | None, *, prompts: bool = True
) -> tuple[Path, list, list]:
    """Check the inputs, then create the run directory (or reopen it to resume); returns
    (run directory, train prompts, held-out prompts), the data loaded by the check (the
    start uses these: nothing reads the data files again).

    Nothing is written before the data, the model and the context length pass, and an
    existing run directory is never replaced unless ``run.overwrite`` asks for it."""
    train, held_out, reports = check_inputs(cfg, prompts=prompts)
    if resume is not None:
        run_dir = reopen_run_dir(Path(resume))
    else:
        run_dir = claim_run_dir(
            cfg.run_dir, overwrite=cfg.run.overwrite, config_text=dump_config(cfg)
        )
    report_data(run_dir, reports, fresh=resume is None)
    return run_dir, train, held_out


def reopen_run_dir(run_dir: Path, state: str | None = None) -> Path:
    """A run directory to resume: say where it starts, and drop metric rows past that point so
    ``metrics.jsonl`` holds each step once (they are replayed). ``state``: the offline
    stage's checkpoint directory (``RUN_DIR/<state>``), else the RL run's checkpoints."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {str(run_dir)!r} is not a run directory (no config.yaml)")
    ckpt = usable_checkpoint(run_dir) if state is None else None
    step = latest_step(ckpt) if state is None else steps_done(run_dir / state)
    if state is not None:
        where = f"step {step}"
    elif ckpt is not None:
        where = f"step {step} ({ckpt})"
    elif (run_dir / SFT_STATE).is_dir():
        where = "the interrupted warm-up"
    elif (run_dir / "sft_model" / "config.json").is_file():
        where = "step 0 (after the warm-up)"
    else:
        where = "the start (no checkpoint was saved)"
    print(f"rlpost: resuming {run_dir} from {where}", file=sys.stderr)
    drop_metrics_after(run_dir, step)
    return run_dir


def open_stage_run_dir(cfg: Config, resume: Path | None, state: str) -> Path:
    """A fresh run directory, or ``resume`` reopened at the steps the checkpoint in
    ``RUN_DIR/<state>`` holds (``rlpost sft`` on conversations, ``rlpost dpo``, ``rlpost rm``)."""
    if resume is None:
        return claim_run_dir(cfg.run_dir, overwrite=cfg.run.overwrite, config_text=dump_config(cfg))
    return reopen_run_dir(Path(resume), state)


def policy_path(path: Path) -> Path:
    """The policy ``path`` names (for ``rlpost export``): a .gguf file or HF directory as it
    is; a checkpoint's ``model/``; a run directory's newest loadable checkpoint's ``model/``,
    else its ``model/`` (rlpost dpo) or ``sft_model/``. Anything else is returned unchanged,
    for the loader to say what is wrong with it."""
    if path.is_file() or (path / "config.json").is_file():
        return path
    if (path / "state.pt").is_file() and (path / "model" / "config.json").is_file():
        return path / "model"
    ckpt = usable_checkpoint(path) if (path / "checkpoints").is_dir() else None
    if ckpt is not None and (ckpt / "model" / "config.json").is_file():
        return ckpt / "model"
    for name in ("model", "sft_model"):
        if (path / name / "config.json").is_file():
            return path / name
    return path


def drop_metrics_after(run_dir: Path, step: int) -> int:
    """Remove rows of steps after ``step`` from metrics.jsonl (they will be replayed); returns
    how many went. The file is rewritten through a temporary file, never truncated in place."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    # A torn line (the run was killed mid-write) goes too: new rows must not be glued to it.
    kept = [line for line in lines if 0 <= _row_step(line) <= step and line.endswith("\n")]
    if len(kept) != len(lines):
        with atomic_write(path, "w", encoding="utf-8") as fh:
            fh.write("".join(kept))
    return len(lines) - len(kept)


def _row_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def schedule(section, seed: int) -> Schedule:
    """The offline loop's schedule a training section (``sft``, ``dpo``, ``rm``) sets."""
    return Schedule(
        section.steps, section.batch_size, section.optim, seed, save_every=section.save_every
    )


def _warm_up_policy(sft_dir: Path):
    try:
        return load_causal_lm(sft_dir)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{exc}; move {sft_dir} aside to run the warm-up again") from None


def load_policy_shown(cfg: Config, console):
    """:func:`build.build_policy`, a phase on ``console`` (None in a worker process: the
    driver shows that one) when it loads a model directory."""
    if cfg.model.path is None or console is None:  # the built-in tiny model: built at once
        return build.build_policy(cfg)
    with console.phase(f"loading the model from {cfg.model.path}"):
        return build.build_policy(cfg)


def on_run_device(cfg: Config, model) -> None:
    """``model`` on the GPU when the run asks for one and this process has one."""
    if cfg.run.device != "cpu" and torch.cuda.is_available():
        model.to("cuda")


def warm_start(cfg: Config, run_dir: Path, train_prompts, console, *, skip_sft: bool):
    """(model, tokenizer) of the starting policy: loaded, then SFT warm-up when configured.

    When resuming, the checkpoint supplies the weights, so SFT is skipped; an
    SFT model already in the run directory is reused rather than retrained."""
    model, tokenizer = load_policy_shown(cfg, console)
    sft_dir = run_dir / "sft_model"
    have_sft = (sft_dir / "config.json").is_file()
    if skip_sft and have_sft and cfg.model.lora.rank > 0:
        # A resume restores only the adapters: they sit on the warm-up policy.
        model.load_state_dict(_warm_up_policy(sft_dir).state_dict())
    if skip_sft or cfg.sft.steps == 0:
        return model, tokenizer
    if have_sft:
        model.load_state_dict(_warm_up_policy(sft_dir).state_dict())
        return model, tokenizer
    s = cfg.sft
    task = console.task("sft warm-up", s.steps)
    if (run_dir / SFT_STATE).is_dir():
        print(f"rlpost: continuing the warm-up from {run_dir / SFT_STATE}", file=sys.stderr)
    on_run_device(cfg, model)  # the warm-up computes where the run does (GPU-less Ray driver: cpu)
    objective = SFT(
        tokenizer,
        train_prompts,
        example=build.agent_demonstrations(cfg, tokenizer),
        distractor=s.distractor,
        device=model_device(model),
    )
    losses = train_offline(
        model,
        objective,
        schedule(s, cfg.run.seed),
        state_dir=run_dir / SFT_STATE,
        tokenizer=tokenizer,
        stop=stop_requested,
        on_step=lambda i, m: console.advance(task, f"loss {m['loss']:.3f}"),
    )
    console.done(task)
    (run_dir / "sft_losses.json").write_text(json.dumps(losses))
    save_model(model, tokenizer, sft_dir, state_dir=run_dir / SFT_STATE)
    return model, tokenizer


def finish_run(
    cfg, run_dir: Path, first_eval, final_eval, history, start_step, wall, console, extra=None
) -> dict:
    summary = {
        "eval_accuracy_start": first_eval.get("eval_accuracy"),
        "eval_accuracy_end": final_eval.get("eval_accuracy"),
        "eval_accuracy_stderr_start": first_eval.get("eval_accuracy_stderr"),
        "eval_accuracy_stderr_end": final_eval.get("eval_accuracy_stderr"),
        "eval_greedy_accuracy_start": first_eval.get("eval_greedy_accuracy"),
        "eval_greedy_accuracy_end": final_eval.get("eval_greedy_accuracy"),
        "eval_greedy_accuracy_stderr_start": first_eval.get("eval_greedy_accuracy_stderr"),
        "eval_greedy_accuracy_stderr_end": final_eval.get("eval_greedy_accuracy_stderr"),
        "eval_temperature": cfg.eval.temperature,
        "eval_problems": first_eval.get("eval_problems"),
        "steps": history[-1]["step"] if history else start_step,  # reached (a stop ends early)
        "steps_this_run": len(history),
        "resumed_from_step": start_step,
        "reward_mean_first": history[0]["reward_mean"] if history else None,
        "reward_mean_last": _tail_mean(history, "reward_mean"),
        "kl_last": history[-1]["kl"] if history else None,
        "wall_seconds": wall,
        "advantage": cfg.algo.advantage.name,
        "policy_loss": cfg.algo.loss.name,
        "data": read_data_counts(run_dir),
        **(extra or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.observe.plot:
        from rlpost.observe.recorder import read_metrics
        from rlpost.observe.report import plot_curves

        plot_curves(read_metrics(run_dir), run_dir / "curves.png")
    console.summary(summary, run_dir)
    return summary


def _tail_mean(history: list[dict], key: str, k: int = 5) -> float | None:
    values = [h[key] for h in history[-k:] if key in h]
    return sum(values) / len(values) if values else None
