"""The agent_blackbox recipe end to end, briefly: rlpost/envs/examples/calc_agent.py (the official
``openai`` client, no rlpost import) trains through recorded sessions (CPU)."""

from __future__ import annotations

import json

import pytest

from rlpost.config import RECIPES_DIR, ConfigError, load_config
from rlpost.pipeline.loop import train
from rlpost.pipeline.rules import check, problems


@pytest.mark.slow
def test_agent_blackbox_trains_the_openai_client_agent(tmp_path):
    over = {
        "run.output_dir": str(tmp_path),
        "sft.steps": 20,
        "rollout.prompts_per_step": 2,
        "rollout.n": 2,
        "train.steps": 2,
        "train.mini_batch_size": 4,
        "train.micro_batch_size": 4,
        "eval.limit": 4,
        "eval.samples": 1,
        "observe.progress": False,
        "observe.plot": False,
        "reward.sample_every": 1,
    }
    cfg = load_config(RECIPES_DIR / "agent_blackbox.yaml", [f"{k}={v}" for k, v in over.items()])
    result = train(cfg)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "harness_sessions" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["harness_sessions"] == 4.0 and r["harness_dropped_frac"] == 0.0
        assert r["agent_turns_mean"] >= 1.0 and r["completions"] >= 4.0
    assert result.summary["eval_accuracy_end"] is not None
    sample = json.loads((result.run_dir / "samples" / "step_1.jsonl").read_text().splitlines()[0])
    assert sample["turns"][0]["role"] == "policy" and "final_turn" in sample


def test_a_harness_with_an_env_or_a_vllm_engine_is_refused():
    base = ["agent.harness.name=rlpost.envs.examples.calc_agent:run"]
    remote = "rollout.engine=remote rollout.engine.servers=[http://127.0.0.1:9]"
    for extra, needle in (
        ("agent.env=calc", "agent.env=calc: agent.harness runs the episodes"),
        ("rollout.engine=vllm", "rollout.engine=vllm: agent"),
        (f"{remote} agent.harness.chat_template=x", "agent.harness.chat_template: remote servers"),
        ("cluster.backend=process", "cluster.backend=process: agent.harness runs in this process"),
        ("rollout.partial=true", "rollout.partial=true: harness sessions never carry"),
    ):
        cfg = load_config(RECIPES_DIR / "grpo_arith.yaml", [*base, *extra.split()])
        with pytest.raises(ConfigError):
            check(cfg)
        assert any(needle in line for line in problems(cfg)), (extra, problems(cfg))
    with pytest.raises(
        ConfigError, match=r"agent\.harness\.command: set it, or agent\.harness\.name"
    ):
        load_config(RECIPES_DIR / "grpo_arith.yaml", ["agent.harness.max_requests=2"])
    cfg = load_config(RECIPES_DIR / "grpo_arith.yaml", [*base, *remote.split()])
    assert problems(cfg) == []  # remote servers: sessions open over their admin routes
