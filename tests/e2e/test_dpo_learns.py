"""The default DPO recipe, shortened, must raise held-out preference accuracy by 20 points."""

from __future__ import annotations

import pytest

from rlpost.commands.offline import run_dpo
from rlpost.config import RECIPES_DIR, load_config

RECIPE = RECIPES_DIR / "dpo_prefs.yaml"


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy(tmp_path):
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.threads=1",
        "dpo.steps=200",
        "dpo.eval_every=0",
        "observe.progress=false",
    ]
    summary = run_dpo(load_config(RECIPE, overrides)).summary
    start, end = summary["eval_pref_accuracy_start"], summary["eval_pref_accuracy_end"]
    assert start == 0.5  # the policy is its own reference before training: all ties
    assert end - start >= 0.20, summary
    assert summary["eval_margin_end"] > summary["eval_margin_start"]
    # The policy itself, not only its ratio to the reference, ranks more pairs correctly.
    assert summary["eval_logp_accuracy_end"] > summary["eval_logp_accuracy_start"], summary
