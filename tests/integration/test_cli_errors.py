"""Every subcommand given bad input answers with one line and no traceback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from rlpost.cli import main

MISSING_EXTRAS = [
    n for n in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(n) is None
]


def _cases(tmp_path, tiny_dir):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("run: [unclosed\n")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    out = f"run.output_dir={tmp_path}"
    file_task = ["data.task=file", f"data.task.train_path={data}", "sft.steps=0", out]
    cases = {
        "train unknown key": ["train", "rollout.nn=2"],
        "train bad value": ["train", "rollout.temperature=-1"],
        "train bad combination": ["train", "rollout.n=1"],
        "train missing recipe": ["train", "no_such_recipe"],
        "train bad yaml": ["train", str(bad_yaml)],
        "train not key=value": ["train", "grpo_arith", "oops"],
        "train resume nothing": ["train", "--resume", str(tmp_path / "none")],
        "train missing model": ["train", f"model.path={tmp_path}/none", out],
        "train missing dataset": [
            "train",
            "data.task=file",
            f"data.task.train_path={tmp_path}/x",
            out,
        ],
        "train template field": [
            "train",
            *file_task,
            "data.prompt_template=Q: {question}",
        ],
        "train bad template": ["train", *file_task, "data.prompt_template={prompt"],
        "train builtin template field": ["train", "data.prompt_template={question}"],
        "train context": ["train", *file_task, f"model.path={tiny_dir}", "rollout.max_tokens=500"],
        "sft unknown key": ["sft", "sft.stepz=3"],
        "sft resume nothing": ["sft", "--resume", str(tmp_path / "none")],
        "eval missing model": ["eval", f"model.path={tmp_path}/none"],
        "eval no eval set": ["eval", *file_task],
        "dpo unknown key": ["dpo", "dpo.bta=0.1"],
        "dpo missing data": ["dpo", "data.task=file", f"data.task.train_path={tmp_path}/x.jsonl"],
        "config unknown key": ["config", "rollout.nn=2"],
        "config keys bad recipe": ["config", "nope", "--keys"],
        "report missing run": ["report", str(tmp_path / "none")],
        "report empty dir": ["report", str(tmp_path)],
        "serve missing model": ["serve", "--model", str(tmp_path / "none")],
        "serve bad flag": ["serve", "--bogus"],
        "sandbox missing file": ["sandbox", "run", str(tmp_path / "none.py")],
        "sandbox no command": ["sandbox"],
        "recipes extra argument": ["recipes", "extra"],
        "rewards extra argument": ["rewards", "extra"],
        "unknown command": ["trian"],
        "no command": [],
    }
    for extra in MISSING_EXTRAS:
        cases[f"train without {extra}"] = ["train", f"observe.loggers=[{extra}]"]
    return cases


def test_every_subcommand_refuses_bad_input_without_a_traceback(tmp_path, tiny_dir, capsys):
    for name, argv in _cases(tmp_path, tiny_dir).items():
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
        err = capsys.readouterr().err
        assert code not in (0, None), name
        assert "Traceback" not in err, (name, err)
        last = err.strip().splitlines()[-1]
        assert "error: " in last and len(last) < 400, (name, err)


@pytest.mark.skipif(not MISSING_EXTRAS, reason="every logger extra is installed")
def test_a_missing_extra_from_the_shell_is_one_line(tmp_path):
    extra = MISSING_EXTRAS[0]
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", f"observe.loggers=[{extra}]"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    if "Traceback" in proc.stderr or proc.returncode != 2:
        pytest.fail(proc.stderr)
    assert proc.stderr.count("\n") == 1 and f"rlpost[{extra}]" in proc.stderr


def test_training_against_a_server_without_an_admin_key_is_one_line(tmp_path, tiny_dir, capsys):
    from tests.conftest import small_overrides
    from tests.integration.test_server import start_server, stop_server

    proc, url = start_server(tiny_dir, env={"RLPOST_ADMIN_KEY": ""})  # the server has none
    try:
        over = small_overrides(
            tmp_path, **{"model.path": str(tiny_dir), "rollout.engine": "remote"}
        )
        code = main(["train", *over, f'rollout.engine.servers=["{url}"]'])
    finally:
        stop_server(proc)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "the server has no admin key" in last and "--admin-key" in last
