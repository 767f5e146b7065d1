"""``rlpost dpo`` end to end on a tiny model in seconds: artifacts, IPO, one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlpost.cli import main
from rlpost.commands.offline import run_dpo
from rlpost.config import RECIPES_DIR, load_config
from rlpost.pipeline.interrupts import Interrupts
from rlpost.train.offline import TrainingStopped
from tests.integration.test_sft_conversations import _StopAfter

RECIPE = RECIPES_DIR / "dpo_prefs.yaml"


def tiny_overrides(tmp_path, **extra) -> list[str]:
    """A seconds-long run of the default recipe."""
    base = {
        "run.output_dir": str(tmp_path),
        "run.name": "d",
        "run.threads": 1,
        "model.tiny.hidden_size": 32,
        "model.tiny.intermediate_size": 64,
        "data.task.max_operand": 9,
        "data.task.eval_size": 20,
        "data.task.train_size": 40,
        "sft.steps": 3,
        "sft.batch_size": 8,
        "dpo.steps": 4,
        "dpo.batch_size": 8,
        "dpo.micro_batch_size": 4,
        "dpo.eval_every": 2,
        "observe.progress": False,
    }
    if "data.task" in extra:  # another task: the built-in task's sizes are not its keys
        base = {k: v for k, v in base.items() if not k.startswith("data.task.")}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_run_writes_everything_a_user_reads(tmp_path):
    assert main(["dpo", *tiny_overrides(tmp_path)]) == 0
    run = tmp_path / "d"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval_pairs"] == 20 and summary["train_pairs"] == 80
    # Before any update the policy is the reference: every pair is a tie.
    assert summary["eval_pref_accuracy_start"] == 0.5 and summary["eval_margin_start"] == 0.0
    for key in ("eval_pref_accuracy_end", "eval_margin_end", "wall_seconds"):
        assert math.isfinite(summary[key])
    assert (run / "config.yaml").is_file() and (run / "model" / "config.json").is_file()
    assert "name: d" in (run / "config.yaml").read_text()
    rows = _rows(run)
    train_steps = [r["step"] for r in rows if "loss" in r]
    eval_steps = [r["step"] for r in rows if "eval_pref_accuracy" in r]
    assert train_steps == [1, 2, 3, 4] and eval_steps == [0, 2, 4]
    for r in rows:
        if "loss" in r:
            assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["skipped"] == 0.0
            assert {"reward_margin", "reward_accuracy", "chosen_reward", "lr"} <= r.keys()


def test_ipo_runs_and_fits_the_pairs_it_trains_on(tmp_path):
    # Four prompts, eight pairs: every step sees the same batch, so the loss must fall.
    ipo = {
        "dpo.loss_type": "ipo",
        "dpo.steps": 12,
        "dpo.optim.lr": 3e-3,
        "dpo.optim.warmup_steps": 0,
    }
    over = tiny_overrides(tmp_path, **ipo, **{"data.task.train_size": 4})
    result = run_dpo(load_config(RECIPE, over))
    assert result.summary["loss_type"] == "ipo" and result.summary["train_pairs"] == 8
    losses = [r["loss"] for r in _rows(result.run_dir) if "loss" in r]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    # IPO regresses h to 1 / (2 beta) = 5: from h = 0 the loss starts at 25.
    assert losses[0] == pytest.approx(25.0, rel=1e-3)
    assert losses[-1] < 0.5 * losses[0]


def test_default_recipe_is_the_cli_default(tmp_path, monkeypatch):
    cfg = load_config(RECIPE, [])
    assert cfg.run.name == "dpo_prefs" and cfg.dpo.beta == 0.1 and cfg.data.task.eval_size >= 200
    seen = {}
    monkeypatch.setattr("rlpost.commands.offline.run_dpo", lambda c, *_: seen.setdefault("cfg", c))
    assert main(["dpo", "dpo.steps=7"]) == 0
    assert seen["cfg"].run.name == "dpo_prefs" and seen["cfg"].dpo.steps == 7


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("dpo.loss_type=hinge", "config dpo.loss_type='hinge'"),
        ("dpo.bta=0.2", "unknown config key 'dpo.bta'"),
        ("dpo.micro_batch_size=16", "micro_batch_size=16 is larger than batch_size=8"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys, override, fragment):
    assert main(["dpo", *tiny_overrides(tmp_path), override]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err
    assert not (tmp_path / "d").exists()  # refused before any work


def _pair_file(path: Path, bad_line: str | None = None) -> str:
    rows = [json.dumps({"q": f"{i}+1=", "good": str(i + 1), "bad": str(i + 3)}) for i in range(12)]
    if bad_line is not None:
        rows.insert(4, bad_line)
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_user_file_bad_row_is_refused_with_file_and_line_or_skipped(tmp_path, capsys):
    train = _pair_file(tmp_path / "train.jsonl", bad_line='{"q": "1+1=", "good": "2"}')
    fields = {
        "data.task": "file",
        "data.task.train_path": train,
        "data.task.prompt_field": "q",
        "data.task.chosen_field": "good",
        "data.task.rejected_field": "bad",
    }
    assert main(["dpo", *tiny_overrides(tmp_path, **fields)]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.jsonl:5: field 'bad' is missing" in err and "\n" not in err
    skip = tiny_overrides(tmp_path, **fields, **{"data.on_bad_row": "skip", "dpo.steps": 2})
    assert main(["dpo", *skip]) == 0
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["train_skipped"] == 1 and summary["train_rows"] == 12
    assert summary["eval_pairs"] + summary["train_pairs"] == 12  # eval_fraction held out


def test_missing_user_file_is_one_line(tmp_path, capsys):
    over = tiny_overrides(
        tmp_path, **{"data.task": "file", "data.task.train_path": tmp_path / "x.jsonl"}
    )
    assert main(["dpo", *over]) == 2
    err = capsys.readouterr().err.strip()
    assert "x.jsonl' does not exist" in err and "\n" not in err


def test_a_stopped_dpo_run_resumes_to_the_weights_of_one_that_never_stopped(tmp_path):
    def cfg(name):
        return load_config(RECIPE, tiny_overrides(tmp_path, **{"run.name": name}))

    full = run_dpo(cfg("full"))
    with Interrupts() as interrupts, pytest.raises(TrainingStopped) as err:
        run_dpo(cfg("cut"), console=_StopAfter(interrupts, 3 + 2))  # 3 warm-up, 2 dpo steps
    run = tmp_path / "cut"
    assert err.value.step == 2 and (run / "dpo_state" / "checkpoints" / "step_2").is_dir()
    assert not (run / "model").exists()
    assert (
        main(["dpo", *tiny_overrides(tmp_path, **{"run.name": "cut"}), "--resume", str(run)]) == 0
    )
    got = AutoModelForCausalLM.from_pretrained(run / "model")
    want = AutoModelForCausalLM.from_pretrained(full.run_dir / "model")
    for p, q in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    cut = json.loads((run / "summary.json").read_text())
    assert cut["eval_pref_accuracy_start"] == 0.5  # the reference came back with the checkpoint
    assert cut["eval_margin_end"] == pytest.approx(full.summary["eval_margin_end"])
    steps = [r["step"] for r in _rows(run) if "loss" in r]
    assert steps == [1, 2, 3, 4] and not (run / "dpo_state").exists()
