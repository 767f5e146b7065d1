"""``rlpost rm``: a short run learns to rank held-out pairs, its output is scored by the
``reward_model`` reward as it is, bad rows are reported with file and line, a stopped run
resumes exactly, and config mistakes are one line (CPU, tiny model)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlpost.cli import main
from rlpost.commands.offline import run_rm
from rlpost.config import RECIPES_DIR, load_config
from rlpost.pipeline.interrupts import Interrupts
from rlpost.pipeline.loop import train
from rlpost.rewards.model import RewardModelWorker
from rlpost.train.offline import TrainingStopped
from rlpost.types import RewardSample

TINY = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64"]


def _pair(rng: random.Random) -> dict:
    """A pair whose preference is learnable: the chosen reply agrees with the prompt's
    mood word, the rejected one does not."""
    mood = rng.choice(["glad", "sad"])
    reply = {"glad": " :)", "sad": " :("}
    other = {"glad": "sad", "sad": "glad"}[mood]
    noise = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
    return {"prompt": f"{noise} {mood}?", "chosen": reply[mood], "rejected": reply[other]}


@pytest.fixture
def pairs_file(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(_pair(rng)) for _ in range(120)]
    lines.insert(4, json.dumps({"prompt": "x", "chosen": "a"}))  # line 5: no rejected
    lines.insert(9, "{not json")  # line 10
    lines.insert(14, json.dumps({"prompt": "x", "chosen": "same", "rejected": "same"}))  # 15
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(tmp_path, pairs_file, *extra):
    return [
        "data.task=file",
        f"data.task.train_path={pairs_file}",
        "data.task.eval_fraction=0.25",
        "data.on_bad_row=skip",
        "rm.batch_size=16",
        "rm.micro_batch_size=8",
        "rm.optim.lr=3e-3",
        "rm.optim.warmup_steps=2",
        "rm.eval_every=10",
        f"run.output_dir={tmp_path}",
        "observe.progress=false",
        *TINY,
        *extra,
    ]


def test_rm_learns_reports_bad_rows_and_its_output_is_a_reward_model(tmp_path, pairs_file, capsys):
    assert main(["rm", *_args(tmp_path, pairs_file, "rm.steps=40", "run.name=r")]) == 0
    run = tmp_path / "r"
    report = json.loads((run / "data_report.json").read_text())
    assert report["train"]["train_skipped"] == 3
    assert report["train"]["skipped_rows"][0].startswith(f"{pairs_file}:5: ")
    assert report["train"]["skipped_rows"][1].startswith(f"{pairs_file}:10: ")
    assert "[identical_pair]" in report["train"]["skipped_rows"][2]
    assert f"{pairs_file}:15" in capsys.readouterr().err
    s = json.loads((run / "summary.json").read_text())
    assert s["train_pairs"] == 90 and s["eval_pairs"] == 30
    assert s["eval_accuracy_end"] >= 0.8 > s["eval_accuracy_start"]
    assert s["eval_loss_end"] < s["eval_loss_start"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 10, 20, 30, 40]
    # The output loads as it is in the reward_model reward and ranks unseen pairs.
    worker = RewardModelWorker(str(run / "rm_model"), batch_size=8)
    rng = random.Random(7)
    fresh = [_pair(rng) for _ in range(20)]
    chosen = worker.score([RewardSample(p["prompt"], p["chosen"]) for p in fresh])
    rejected = worker.score([RewardSample(p["prompt"], p["rejected"]) for p in fresh])
    assert sum(c > r for c, r in zip(chosen, rejected, strict=True)) >= 16
    worker.batch_size = 1  # padding does not move a score
    alone = worker.score([RewardSample(p["prompt"], p["chosen"]) for p in fresh])
    assert alone == pytest.approx(chosen, abs=1e-4)


def test_a_bad_row_under_on_bad_row_error_is_one_line_with_file_and_line(
    tmp_path, pairs_file, capsys
):
    args = _args(tmp_path, pairs_file, "data.on_bad_row=error", "rm.steps=2", "run.name=e")
    assert main(["rm", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlpost: error: {pairs_file}:5: ") and "\n" not in err
    assert not (tmp_path / "e").exists()  # nothing written before the inputs pass


def test_margin_column_enters_the_loss(tmp_path):
    path = tmp_path / "m.jsonl"
    rng = random.Random(1)
    path.write_text("".join(json.dumps({**_pair(rng), "m": 2.0}) + "\n" for _ in range(24)))
    args = _args(tmp_path, path, "rm.steps=1", "run.name=m", "rm.margin_field=m")
    assert main(["rm", *args]) == 0
    s = json.loads((tmp_path / "m" / "summary.json").read_text())
    # At the start both rewards are about equal: the loss is about softplus(2), not log 2.
    assert s["eval_loss_start"] == pytest.approx(2.127, abs=0.1)
    assert s["margin_field"] == "m"


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


def test_a_stopped_rm_run_resumes_where_it_stopped(tmp_path, pairs_file):
    def cfg(name):
        over = _args(tmp_path, pairs_file, "rm.steps=6", "rm.save_every=0", f"run.name={name}")
        return load_config(None, over)

    run_rm(cfg("full"))
    with Interrupts() as interrupts, pytest.raises(TrainingStopped) as err:
        run_rm(cfg("cut"), console=_StopAfter(interrupts, 3))
    run = tmp_path / "cut"
    assert (
        err.value.step == 3 and (run / "rm_state" / "checkpoints" / "step_3" / "state.pt").is_file()
    )
    assert not (run / "rm_model").exists()
    out = run_rm(cfg("cut"), resume=run)
    got = AutoModelForSequenceClassification.from_pretrained(out)
    want = AutoModelForSequenceClassification.from_pretrained(tmp_path / "full" / "rm_model")
    for p, q in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    cut = json.loads((run / "summary.json").read_text())
    assert cut["eval_accuracy_end"] == pytest.approx(full["eval_accuracy_end"])
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 0] == [1, 2, 3, 4, 5, 6]  # each step once
    assert not (run / "rm_state").exists()


@pytest.mark.parametrize(
    ("over", "words"),
    [
        (
            ["data.task=arith"],
            "rlpost dpo and rlpost rm train on preference pairs: data.task=arith",
        ),
        (["data.task=file"], "data.task.train_path=None: data.task=file reads its rows"),
        (["rm.margin_field=m"], "rm.margin_field=m: data.task=prefs has no columns"),
        (["rm.micro_batch_size=100"], "micro_batch_size=100 is larger than batch_size=64"),
        (["rm.stpes=3"], "rm.stpes"),
    ],
)
def test_config_mistakes_are_one_line(tmp_path, capsys, over, words):
    assert main(["rm", f"run.output_dir={tmp_path}", *over]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlpost: error: ") and words in err and "\n" not in err
    assert not any(tmp_path.iterdir())


def test_the_rlhf_recipe_trains_against_the_trained_reward_model(tmp_path, pairs_file):
    """The pipeline's RL stage on a freshly trained reward model: the RM is a reward term
    of the mixed reward, and the run reports the RM's held-out score and the verifiable
    accuracy side by side."""
    assert main(["rm", *_args(tmp_path, pairs_file, "rm.steps=2", "run.name=rm")]) == 0
    rm = tmp_path / "rm" / "rm_model"
    recipe = tmp_path / "rlhf.yaml"
    arith = {"max_operand": 30, "ops": ["+", "-"], "eval_size": 8}
    term = {"name": "reward_model", "kind": "model", "path": str(rm)}
    recipe.write_text(
        json.dumps(
            {
                "base": str(RECIPES_DIR / "rlhf_arith.yaml"),
                "model": {"path": None},
                "reward": {"terms": [{"name": "numeric_match"}, term]},
                "eval": {
                    "every": 0,
                    "sets": [
                        {
                            "name": "verifiable",
                            "task": {"name": "arith", **arith},
                            "metrics": ["mean@2"],
                            "reward": [{"name": "numeric_match"}],
                        },
                        {
                            "name": "rm",
                            "task": {"name": "arith", **arith},
                            "metrics": ["mean@2"],
                            "reward": [term],
                        },
                    ],
                },
            }
        )
    )
    over = [
        "train.steps=1",
        "rollout.prompts_per_step=4",
        "rollout.n=2",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        f"run.output_dir={tmp_path}",
        "observe.progress=false",
        "observe.plot=false",
    ]
    result = train(load_config(recipe, over))
    sets = result.summary["eval_sets"]
    for name in ("verifiable", "rm"):
        assert sets[name]["problems"] == 8
        assert sets[name]["reward_mean_start"] is not None
        assert sets[name]["reward_mean_end"] is not None
    # The verifiable set's mean score is its accuracy (exact match scores 0 or 1); the RM
    # set's is the raw reward-model score, scored by the model just trained.
    v = sets["verifiable"]
    assert v["reward_mean_end"] == pytest.approx(v["mean@2_end"])
    worker = RewardModelWorker(str(rm))
    assert worker.model.config.num_labels == 1
