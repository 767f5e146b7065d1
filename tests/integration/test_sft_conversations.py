"""``rlpost sft`` on a conversation file: bad rows reported, held-out loss falls, a stopped
run resumes exactly, and the output is a model.path for rlpost train (CPU, tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlpost.cli import main
from rlpost.commands.offline import run_conversation_sft
from rlpost.config import load_config
from rlpost.data.conversations import Conversation, chat_arith
from rlpost.models.loading import load_policy
from rlpost.pipeline.interrupts import Interrupts
from rlpost.pipeline.loop import train
from rlpost.train.offline import TrainingStopped

TINY = ["model.tiny.max_position_embeddings=256", "model.tiny.hidden_size=32"]


def write_conversations(convs: list[Conversation], path: str | Path) -> Path:
    """``convs`` as a JSONL file of ``{"messages", "answer"}`` rows."""
    p = Path(path)
    rows = [json.dumps({"messages": c.messages, "answer": c.answer}) for c in convs]
    p.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return p


@pytest.fixture
def chats(tmp_path):
    path = write_conversations(chat_arith(60, seed=1), tmp_path / "chats.jsonl")
    with path.open("a") as f:  # two bad rows at lines 61 and 62
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "judge", "content": "x"}]}) + "\n")
    return path


def _cfg(tmp_path, chats, *extra):
    over = [
        "sft.data=file",
        f"sft.train_path={chats}",
        "sft.eval_fraction=0.2",
        "sft.batch_size=8",
        "sft.optim.lr=3e-3",
        "sft.optim.warmup_steps=2",
        "sft.max_tokens_per_micro_batch=600",
        "sft.eval_max_tokens=4",
        "data.on_bad_row=skip",
        f"run.output_dir={tmp_path}",
        "observe.progress=false",
        *TINY,
        *extra,
    ]
    return load_config(None, over)


def test_sft_on_a_file_reports_bad_rows_and_the_output_trains_with_rlpost_train(
    tmp_path, chats, capsys
):
    over = [f"sft.train_path={chats}", "sft.steps=12", "run.name=s", f"run.output_dir={tmp_path}"]
    code = main(["sft", *_overrides(), *over])
    assert code == 0
    run = tmp_path / "s"
    report = json.loads((run / "data_report.json").read_text())
    assert report["train"]["train_skipped"] == 2
    assert report["train"]["skipped_rows"] == [
        f"{chats}:61: the conversation has no assistant turn to train on [no_assistant]",
        f"{chats}:62: message 1 has role 'judge'; roles are system, user, assistant, tool "
        "[unknown_role]",
    ]
    assert f"{chats}:61" in capsys.readouterr().err
    s = json.loads((run / "summary.json").read_text())
    assert s["train_examples"] == 48 and s["eval_examples"] == 12
    assert s["eval_loss_end"] < s["eval_loss_start"] - 0.5
    assert s["eval_accuracy_start"] is not None  # the rows carry answers
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == list(range(1, 13))  # once each
    assert rows[-1]["eval_loss"] == s["eval_loss_end"]  # the final evaluation is in the log
    assert rows[-1]["eval_accuracy"] == s["eval_accuracy_end"]
    # The output is a checkpoint with its chat template: the loader and rlpost train take it.
    model, tok = load_policy(run / "sft_model")
    assert tok.chat_template and model.config.hidden_size == 32
    cfg = load_config(
        None,
        [
            f"model.path={run / 'sft_model'}",
            "sft.steps=0",
            "train.steps=1",
            "rollout.prompts_per_step=2",
            "rollout.n=2",
            "train.mini_batch_size=4",
            "train.micro_batch_size=4",
            "eval.limit=4",
            "eval.samples=1",
            "run.name=rl",
            f"run.output_dir={tmp_path}",
            "observe.progress=false",
            "observe.plot=false",
        ],
    )
    result = train(cfg)
    assert result.summary["steps"] == 1
    assert (tmp_path / "rl" / "summary.json").is_file()


def _overrides():
    return [
        "sft.data=file",
        "sft.eval_fraction=0.2",
        "sft.batch_size=8",
        "sft.optim.warmup_steps=2",
        "sft.max_tokens_per_micro_batch=600",
        "sft.eval_max_tokens=4",
        "data.on_bad_row=skip",
        "observe.progress=false",
        *TINY,
    ]


class _StopAfter:
    """A progress display that asks the run to stop after ``n`` steps (as Ctrl-C would)."""

    def __init__(self, interrupts, n):
        self.interrupts, self.n, self.seen = interrupts, n, 0

    def task(self, name, total):
        return name

    def advance(self, task, info=""):
        self.seen += 1
        if self.seen == self.n:
            self.interrupts.stop.set()

    def done(self, task):
        """The progress bar's end: the stop was set at the counted step."""


def test_a_stopped_conversation_sft_resumes_where_it_stopped(tmp_path, chats):
    full_cfg = _cfg(tmp_path, chats, "sft.steps=6", "run.name=full", "sft.save_every=0")
    run_conversation_sft(full_cfg)
    full = json.loads((tmp_path / "full" / "sft_losses.json").read_text())
    cfg = _cfg(tmp_path, chats, "sft.steps=6", "run.name=cut", "sft.save_every=0")
    with Interrupts() as interrupts, pytest.raises(TrainingStopped) as err:
        run_conversation_sft(cfg, console=_StopAfter(interrupts, 3))
    run = tmp_path / "cut"
    assert (
        err.value.step == 3
        and (run / "sft_state" / "checkpoints" / "step_3" / "state.pt").is_file()
    )
    assert not (run / "sft_model").exists()
    out = run_conversation_sft(cfg, resume=run)
    assert json.loads((run / "sft_losses.json").read_text()) == pytest.approx(full, rel=1e-5)
    a, _ = load_policy(out)
    b, _ = load_policy(tmp_path / "full" / "sft_model")
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 0] == [1, 2, 3, 4, 5, 6]  # each step once
    assert not (run / "sft_state").exists()
