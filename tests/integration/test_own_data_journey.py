"""The own-data journey as the README gives it: a Hugging Face checkpoint with a BPE tokenizer
and a chat template, a GSM8K-style JSONL file with bad rows of every kind, the shipped
grpo_file recipe run from a directory outside the repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.journey_data import gsm8k_rows, save_bpe_checkpoint, write_jsonl

BAD_LINES = {  # reason -> raw line
    "not_utf8": b'{"question": "caf\xe9 au lait?", "answer": "#### 3"}',
    "invalid_json": b'{"question": "oops", ',
    "not_object": b'"just a string"',
    "empty_prompt": json.dumps({"question": " ", "answer": "#### 1"}).encode(),
    "missing_answer": json.dumps({"question": "How many?"}).encode(),
    "empty_answer": json.dumps({"question": "How many?", "answer": ""}).encode(),
    "prompt_too_long": json.dumps({"question": "many " * 400, "answer": "#### 2"}).encode(),
}
TINY_RUN = [
    "train.steps=2",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_tokens=24",
    "train.mini_batch_size=4",
    "train.micro_batch_size=2",
    "eval.limit=4",
    "observe.progress=false",
    "observe.plot=false",
    "reward.sample_every=1",
    "checkpoint.every=1",
]


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    root = tmp_path_factory.mktemp("journey")
    rows = gsm8k_rows(48)
    model = save_bpe_checkpoint(root / "my-model", [r["question"] + r["answer"] for r in rows])
    write_jsonl(root / "train.jsonl", rows[:40], list(BAD_LINES.values()))
    write_jsonl(root / "test.jsonl", rows[40:])
    return root, model


def test_own_model_and_data_run_to_the_end_with_every_bad_row_reported(journey):
    root, model = journey
    command = [
        "train",
        "grpo_file",
        f"model.path={model}",
        "data.task.train_path=train.jsonl",
        "data.task.eval_path=test.jsonl",
        "data.task.prompt_field=question",
        *TINY_RUN,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", *command],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for line, reason in enumerate(BAD_LINES, start=41):
        assert f"train.jsonl:{line}: " in proc.stderr and f"[{reason}]" in proc.stderr, reason
    run = root / "runs" / "grpo_file"
    data = json.loads((run / "summary.json").read_text())["data"]
    assert data["train_rows"] == 40 and data["train_skipped"] == len(BAD_LINES)
    assert all(data[f"train_skipped_{reason}"] == 1 for reason in BAD_LINES)
    assert data["eval_rows"] == 8 and data["eval_skipped"] == 0
    assert not (run / "sft_model").exists()  # the checkpoint is the starting policy
    sample = json.loads((run / "samples" / "step_1.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("<|user|>\n") and sample["prompt"].endswith(
        "<|assistant|>\n"
    )
    assert "####" in str(sample["answer"])
