"""Multi-turn episodes train exactly what was sampled (CPU, a real tiny model and engine).

The bar of multi-turn RL: the tokens the trainer sees are the tokens the engine
sampled, turn after turn, conditioned on exactly the context it sampled them in
(token in, token out: the tool's output appended as tokens, nothing re-tokenized);
and the tool-output tokens get no gradient, checked on real gradients (the logits'
and the trainer's optimizer update).
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlpost.algos import get_policy_loss
from rlpost.algos.aggregate import Aggregation
from rlpost.algos.policy_losses import LossInputs
from rlpost.config import Config, OptimConfig
from rlpost.data.arith import arith_problems
from rlpost.envs.catalog import env_factory
from rlpost.envs.formats import TagFormat, demonstration_completion
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
from rlpost.params import PPOClipParams
from rlpost.pipeline.build import build_trainer
from rlpost.pipeline.stages import collate_groups, turn_rewards
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.episodes.multiturn import MultiTurnRollout
from rlpost.rollout.worker import to_groups
from rlpost.train.batch import response_logits, token_logprobs
from rlpost.train.offline import Schedule, train_offline
from rlpost.train.sft import SFT


class Recording:
    """The real engine, with every (input ids, completion) it handled kept for the checks."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    @property
    def version(self):
        return self.engine.version

    def generate(self, prompt_ids, params, n=1, group_offset=0):
        out = self.engine.generate(prompt_ids, params, n=n, group_offset=group_offset)
        inputs = [list(p) for p in prompt_ids for _ in range(n)]
        self.seen += list(zip(inputs, out, strict=True))
        return out


@pytest.fixture(scope="module")
def episodes():
    """A tiny policy warmed up on calculator demonstrations, and 16 of its episodes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models are overhead-bound: one thread is the fastest
    try:
        yield _episodes()
    finally:
        torch.set_num_threads(threads)


def calc_policy():
    """(model, tokenizer, problems): a tiny policy warmed up on calculator demonstrations of
    one-digit products (short episodes: a few seconds of warm-up on one thread)."""
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0)
    problems = arith_problems(9, ["*"])
    make_env, fmt = env_factory("calc"), TagFormat()

    def example(prompt, rng):
        return demonstration_completion(make_env(), prompt, fmt, tok, rng)

    train_offline(model, SFT(tok, problems[8:], example), Schedule(60, 16, OptimConfig(lr=5e-3)))
    return model, tok, problems


def _episodes():
    model, tok, problems = calc_policy()
    make_env, fmt = env_factory("calc"), TagFormat()
    serving = copy.deepcopy(model).requires_grad_(False)
    engine = Recording(HFEngine(serving, tok, batch_size=64, seed=0, version=7))
    agent = MultiTurnRollout(engine, tok, env=make_env, max_turns=3, fmt=fmt)
    prompts = problems[:8]
    ids = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=(tok.eos_token_id,))
    completions = agent.generate(ids, params, n=2, prompts=prompts)
    return model, tok, engine, agent, to_groups(prompts, completions, 2)


def test_trained_tokens_are_the_sampled_tokens_across_turns(episodes):
    model, tok, engine, _, groups = episodes
    completions = [c for g in groups for c in g.completions]
    multi = [c for c in completions if c.episode.tool_calls >= 1 and c.episode.policy_turns >= 2]
    assert multi, "the warmed-up policy should call the calculator in some episodes"
    for c in completions:
        for turn in c.episode.turns:
            span = c.token_ids[turn.start : turn.end]
            context = c.prompt_ids + c.token_ids[: turn.start]
            if turn.role == "policy":
                # Token in: the engine was given exactly this context; token out: these are
                # its sampled ids (a prefix: a turn is cut after its call) and logprobs.
                match = [
                    out
                    for inp, out in engine.seen
                    if inp == context and out.token_ids[: len(span)] == span
                ]
                assert match, f"policy turn {turn} was not sampled in this context"
                assert c.logprobs[turn.start : turn.end] == match[0].logprobs[: len(span)]
                assert c.loss_mask[turn.start : turn.end] == [1] * len(span)
                assert set(c.token_versions[turn.start : turn.end]) == {7}
            else:
                text = tok.decode(span)  # the calculator's answer (cut short by the token budget)
                assert text[:8] == "<result>"[: len(text)]
                assert c.loss_mask[turn.start : turn.end] == [0] * len(span)
                assert c.logprobs[turn.start : turn.end] == [0.0] * len(span)
    batch = _batch(groups)
    for row, c in enumerate(completions):
        r = len(c.token_ids)
        assert batch.responses[row, :r].tolist() == c.token_ids
        assert batch.response_mask[row, :r].tolist() == [float(m) for m in c.loss_mask]
    # The trainer recomputes the engine's logprobs on the policy's tokens: same ids, same
    # context (a re-tokenized or shifted turn would be off by whole nats).
    trainer = build_trainer(Config(), model)
    old = trainer.old_logprobs(batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(old[mask], batch.rollout_logprobs[mask], atol=1e-3)


def _batch(groups, seed=0):
    for g in groups:
        g.scores = [1.0, 0.0]
    batch = collate_groups(groups, 0)
    gen = torch.Generator().manual_seed(seed)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=gen)
    batch.old_logprobs = batch.rollout_logprobs.clone()
    return batch


def test_tool_output_tokens_carry_no_gradient(episodes):
    model, _, _, _, groups = episodes
    batch = _batch(groups)
    mask = batch.response_mask
    tool = (mask == 0) & (batch.token_versions >= 0)  # tool output (not padding)
    assert tool.any() and (mask > 0).any()
    # 1. The gradient of the real loss with respect to the logits at each position.
    policy = copy.deepcopy(model)
    logits = response_logits(policy, batch)
    logits.retain_grad()
    logprobs = token_logprobs(logits, batch.responses)
    agg = Aggregation.for_minibatch(mask, "token-mean")
    x = LossInputs(logprobs, batch.old_logprobs, batch.advantages, mask, agg)
    loss = get_policy_loss("ppo_clip")(x, PPOClipParams()).loss
    loss.backward()
    per_position = logits.grad.abs().sum(-1)
    assert per_position[tool].max().item() == 0.0
    assert per_position[mask > 0].min().item() > 0.0
    # 2. The trainer's update: whatever advantages, old logprobs or engine logprobs sit on
    # tool tokens, the weights after one optimizer step are bit-identical.
    cfg = Config(
        rollout={"prompts_per_step": 8, "n": 2},
        train={"mini_batch_size": 16, "micro_batch_size": 16},
    )
    noisy = _batch(groups)
    noisy.advantages[tool] = 100.0 * torch.randn(int(tool.sum()))
    noisy.old_logprobs[tool] = -5.0
    noisy.rollout_logprobs[tool] = -7.0
    moved = _batch(groups)
    first = int(mask[0].nonzero()[0])
    moved.advantages[0, first] += 10.0  # a policy token: the update must change
    weights = []
    for b in (batch, noisy, moved):
        torch.manual_seed(0)
        trainer = build_trainer(cfg, copy.deepcopy(model))
        trainer.update(b)
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_per_turn_rewards_land_on_the_turn_that_earned_them(episodes):
    _, _, _, _, groups = episodes
    groups = copy.deepcopy(groups)
    c = next(c for g in groups for c in g.completions if c.episode.tool_calls)
    c.episode.turns[0].reward = 0.5
    batch = _batch(groups)
    row = [x for g in groups for x in g.completions].index(c)
    rewards = turn_rewards(groups, batch.response_mask)
    first = c.episode.turns[0]
    assert rewards[row, first.end - 1].item() == 0.5 and rewards.sum().item() == 0.5
    plain = copy.deepcopy(groups)
    for g in plain:
        for x in g.completions:
            for t in x.episode.turns:
                t.reward = 0.0
    assert turn_rewards(plain, batch.response_mask) is None


def test_per_turn_rewards_reach_the_advantage_estimator(episodes):
    """Two episodes of one prompt with the same outcome: the one whose turn earned a reward
    gets the positive GRPO advantage."""
    from rlpost.config import AlgoConfig
    from rlpost.pipeline.stages import compute_advantages

    _, _, _, _, groups = episodes
    group = copy.deepcopy(groups[0])
    group.completions[0].episode.turns[0].reward = 0.5
    for c in group.completions[1:]:
        for t in c.episode.turns:
            t.reward = 0.0
    group.scores = [1.0] * group.n
    batch = collate_groups([group], 0)
    adv = compute_advantages(
        batch, AlgoConfig(), beta=0.0, turn_rewards=turn_rewards([group], batch.response_mask)
    ).advantages
    first, second = (float(adv[i][batch.response_mask[i] > 0][0]) for i in (0, 1))
    assert first > 0 > second
    outcome = compute_advantages(batch, AlgoConfig(), beta=0.0)  # outcome only: no difference
    assert torch.all(outcome.advantages == 0)
