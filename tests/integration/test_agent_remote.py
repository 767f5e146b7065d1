"""Multi-turn episodes against `rlpost serve` on loopback: token ids round-trip, and the
training loop runs episodes through remote engines."""

from __future__ import annotations

import json

import torch

from rlpost.config import Config, load_config
from rlpost.envs.catalog import env_factory
from rlpost.envs.formats import TagFormat
from rlpost.models.tiny import save_tiny_checkpoint
from rlpost.pipeline.build import build_trainer
from rlpost.pipeline.loop import train
from rlpost.pipeline.stages import collate_groups
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.rollout.episodes.multiturn import MultiTurnRollout
from rlpost.rollout.worker import to_groups
from tests.conftest import small_overrides
from tests.integration.test_server import start_server, stop_server
from tests.unit.pipeline.test_agent_training import Recording, calc_policy


def test_episodes_through_a_server_keep_the_sampled_ids(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok, problems = calc_policy()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(tmp_path / "calc")
    tok.save_pretrained(tmp_path / "calc")
    proc, url = start_server(tmp_path / "calc", "--max-tokens-limit", "64")
    try:
        engine = Recording(RemoteEngine([url], tok, seed=0))
        agent = MultiTurnRollout(engine, tok, env=env_factory("calc"), max_turns=3, fmt=TagFormat())
        prompts = problems[:6]
        ids = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        params = SamplingParams(max_tokens=40, stop_token_ids=(tok.eos_token_id,))
        groups = to_groups(prompts, agent.generate(ids, params, n=2, prompts=prompts), 2)
    finally:
        stop_server(proc)
    completions = [c for g in groups for c in g.completions]
    assert agent.last_stats.tool_calls >= 1 and agent.last_stats.episodes == 12
    for c in completions:
        for turn in (t for t in c.episode.turns if t.role == "policy"):
            context = c.prompt_ids + c.token_ids[: turn.start]
            span = c.token_ids[turn.start : turn.end]
            assert any(i == context and o.token_ids[: len(span)] == span for i, o in engine.seen)
    # The server's logprobs are the local model's on the same ids: nothing was re-tokenized
    # on the way (a changed id or context would be off by whole nats).
    for g in groups:
        g.scores = [0.0, 1.0]
    batch = collate_groups(groups, tok.pad_token_id)
    local = build_trainer(Config(), model).old_logprobs(batch)
    mask = batch.response_mask.bool()
    assert (batch.response_mask == 0).logical_and(batch.token_versions >= 0).any()
    assert torch.allclose(local[mask], batch.rollout_logprobs[mask], atol=1e-3)


def test_training_loop_runs_episodes_on_remote_engines(tmp_path):
    model_dir = save_tiny_checkpoint(tmp_path / "tiny")  # the default tiny shape
    proc, url = start_server(model_dir, "--max-tokens-limit", "64")
    try:
        over = small_overrides(
            tmp_path,
            **{
                "model.path": str(model_dir),
                "model.tiny.hidden_size": 64,
                "model.tiny.intermediate_size": 256,
                "rollout.engine": "remote",
                "rollout.engine.servers": json.dumps([url]),
                "rollout.max_tokens": 48,
                "data.task.max_operand": 9,
                "data.task.eval_size": 20,
                "agent.env": "calc",
                "run.threads": 1,  # tiny models are overhead-bound: one thread is the fastest
                "sft.steps": 80,
                "sft.optim.lr": 5e-3,
                "sft.batch_size": 16,
                "train.steps": 2,
                "eval.every": 0,
                "checkpoint.every": 0,
            },
        )
        result = train(load_config(None, over))
    finally:
        stop_server(proc)
    rows = [h for h in result.history if "loss" in h]
    assert len(rows) == 2
    for r in rows:
        assert r["logprob_gap"] < 1e-3  # the server samples with the trainer's weights
        assert r["agent_tool_calls"] >= 1 and r["agent_turns_mean"] > 1.0
    assert result.summary["eval_accuracy_end"] is not None
