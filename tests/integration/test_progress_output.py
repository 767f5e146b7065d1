"""Every long phase says what it is doing: `rlpost eval` of a model directory shows the
model loading and the held-out evaluation, with its size, and nothing with
observe.progress=false."""

from __future__ import annotations

import pytest

from rlpost.cli import main


@pytest.mark.parametrize("progress", [True, False])
def test_eval_shows_loading_and_evaluation_progress(tiny_dir, capsys, progress):
    over = [
        f"model.path={tiny_dir}",
        "eval.limit=6",
        "eval.samples=2",
        "rollout.max_tokens=4",
        f"observe.progress={str(progress).lower()}",
    ]
    assert main(["eval", *over]) == 0
    out, err = capsys.readouterr()
    assert "eval_accuracy:" in out
    lines = [
        f"loading the model from {tiny_dir} ...",
        "held-out evaluation: 6 problems x 2 samples at T=1 ...",
    ]
    if progress:
        assert all(line in err for line in lines), err
        assert "12/12" in err  # the bar's end: every sample counted
    else:
        assert not any(line in err for line in lines) and "12/12" not in err, err
