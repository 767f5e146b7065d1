"""LoRA in the loop: only the adapters train, the reference is the base with adapters off, the
engine samples from the merged weights, and checkpoints resume the adapters (CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="LoRA needs the [lora] extra (peft)")

from rlpost.config import load_config
from rlpost.models.loading import load_causal_lm
from rlpost.pipeline.loop import train


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.name=lora",
            "run.threads=1",
            "sft.steps=0",
            "train.steps=4",
            "rollout.prompts_per_step=8",
            "rollout.n=4",
            "rollout.max_tokens=6",
            "train.mini_batch_size=32",
            "train.micro_batch_size=32",
            "train.optim.lr=2e-2",
            "train.optim.warmup_steps=0",
            "algo.kl.beta=0.01",
            "model.lora.rank=8",
            "eval.limit=4",
            "eval.every=0",
            "checkpoint.every=2",
            "observe.progress=false",
            "observe.plot=false",
            "reward.terms=[{name: 'tests.integration.rewards_for_tests:length_reward'}]",
            *extra,
        ],
    )


def test_lora_trains_adapters_against_the_base_and_resumes(tmp_path):
    result = train(_cfg(tmp_path))
    h = result.history
    # the reference is the base: KL is 0 until the adapters move, then grows
    assert h[0]["kl"] == 0.0 and h[-1]["kl"] > 0.0
    # the engine serves the merged weights: its logprobs match the trainer's recompute
    assert all(x["logprob_gap"] < 1e-3 for x in h)
    ckpt = result.run_dir / "checkpoints" / "step_4"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    merged = load_causal_lm(ckpt / "model")  # an ordinary checkpoint with the adapters folded in
    start = load_causal_lm(ckpt.parent / "step_2" / "model")
    moved = [
        n for n, p in merged.named_parameters() if not p.equal(dict(start.named_parameters())[n])
    ]
    assert moved and all("proj" in n for n in moved)  # only adapted layers changed
    resumed = train(_cfg(tmp_path, "train.steps=6"), resume=result.run_dir)
    assert [x["step"] for x in resumed.history] == [5, 6]
