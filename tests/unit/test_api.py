"""The Python API on the built-in tiny model (CPU): what it samples is what it scores, its step
is the trainer's step, policies on one base stay apart, and bad data is one named line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import rlpost
from rlpost.api import APIError, Datum
from rlpost.config import OptimConfig
from rlpost.params import PPOClipParams
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.batch import collate


@pytest.fixture(scope="module")
def base():
    return rlpost.Base.load(None, seed=0)


def rollout(policy, base, n=4, seed=1):
    prompt = base.tokenizer.encode("12+7=")
    params = rlpost.SamplingParams(max_tokens=6, seed=seed)
    return prompt, policy.sample([prompt], params, n=n)


def as_data(prompt, completions, advantages):
    """Tinker's layout: tokens in, the next token as target, weight 1 on the response."""
    data = []
    for c, a in zip(completions, advantages, strict=True):
        seq = [*prompt, *c.token_ids]
        p, t = len(prompt) - 1, len(c.token_ids)
        data.append(
            Datum(
                seq[:-1], seq[1:], [0.0] * p + [1.0] * t,
                {"logprobs": [0.0] * p + list(c.logprobs), "advantages": [0.0] * p + [a] * t},
            )
        )  # fmt: skip
    return data


def test_sampled_logprobs_are_the_forward_logprobs(base):
    policy = base.policy(rlpost.LoRA(rank=4))
    prompt, out = rollout(policy, base)
    data = as_data(prompt, out, [1.0] * len(out))
    for c, lp in zip(out, policy.forward(data), strict=True):
        got = lp[len(prompt) - 1 :]
        assert torch.allclose(got, torch.tensor(c.logprobs), atol=1e-5), (got, c.logprobs)
    policy.close()


def test_a_step_equals_the_trainers_update(base):
    """forward_backward + optim_step of a full policy == PolicyTrainer.update on the same
    completions laid out as ``rlpost train`` lays them (collate), to 1e-6."""
    policy = base.policy(None, lr=1e-3)
    reference = copy.deepcopy(policy.model)
    prompt, out = rollout(policy, base)
    advantages = [1.0, -1.0, 0.5, -0.5]
    policy.forward_backward(as_data(prompt, out, advantages), "ppo_clip")
    policy.optim_step(lr=1e-3, betas=(0.9, 0.999), grad_clip=1.0)

    settings = ActorSettings(
        optim=OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0, betas=(0.9, 0.999)),
        mini_batch_size=64, micro_batch_size=64,
    )  # fmt: skip
    trainer = PolicyTrainer(reference.requires_grad_(True), PPOClipParams(), settings)
    batch = collate(out, [0.0] * len(out), base.tokenizer.pad_token_id)
    adv = torch.tensor(advantages)[:, None] * batch.response_mask
    trainer.update(
        type(batch)(**{**batch.__dict__, "advantages": adv, "old_logprobs": batch.rollout_logprobs})
    )
    for (name, a), b in zip(policy.model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    policy.close()


def test_policies_on_one_base_stay_apart(base):
    one, two = base.policy(rlpost.LoRA(rank=4)), base.policy(rlpost.LoRA(rank=2))
    prompt, out = rollout(one, base)
    data = as_data(prompt, out, [1.0, -1.0, 1.0, -1.0])
    before = two.forward(data)
    sampler = one.snapshot()
    one.forward_backward(data, "reinforce", agg="token-sum")
    one.optim_step(lr=5e-2)
    after_one = one.forward(data)
    for a, b in zip(before, two.forward(data), strict=True):
        assert torch.equal(a, b)  # the other adapter did not move
    assert any(not torch.allclose(a, b) for a, b in zip(before, after_one, strict=True))
    for a, b in zip(before, sampler.forward(data), strict=True):
        assert torch.allclose(a, b, atol=1e-6)  # the snapshot is the policy before the step
    sampler.close()
    one.close()
    two.close()


def test_state_round_trip_resumes_exactly(base, tmp_path):
    policy = base.policy(rlpost.LoRA(rank=4))
    prompt, out = rollout(policy, base)
    data = as_data(prompt, out, [1.0, -1.0, 0.5, 0.0])
    policy.forward_backward(data, "ppo_clip")
    policy.optim_step(lr=1e-2)
    policy.save_state(tmp_path / "s")
    policy.forward_backward(data, "ppo_clip")
    policy.optim_step(lr=1e-2)
    expected = policy.forward(data)

    other = base.policy(rlpost.LoRA(rank=4))
    other.load_state(tmp_path / "s")
    other.forward_backward(data, "ppo_clip")
    other.optim_step(lr=1e-2)
    for a, b in zip(expected, other.forward(data), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    policy.close()
    other.close()


@pytest.mark.parametrize(
    "datum, field",
    [
        (Datum([1, 2, 3], [2, 3]), "data[0].targets: 2 values for 3 tokens"),
        (Datum([1, 2, 3], [2, 3, 4], [1.0]), "data[0].weights: 1 values for 3 tokens"),
        (Datum([1, 2], [2, 3], None, {"advantages": [float("nan"), 1.0]}), "data[0].advantages"),
        (Datum([], []), "data[0].tokens: empty"),
        (Datum([1] * 500, [1] * 500), "past the model's context"),
    ],
)
def test_bad_data_is_one_named_line(base, datum, field):
    policy = base.policy(rlpost.LoRA(rank=2))
    with pytest.raises(APIError, match=field.replace("[", r"\[").replace("]", r"\]")):
        policy.forward_backward([datum], "ppo_clip")
    with pytest.raises(APIError, match="no gradients accumulated"):
        policy.optim_step()
    with pytest.raises(APIError, match="unknown; valid"):
        policy.forward_backward([Datum([1, 2], [2, 3])], "no_such_loss")
    policy.close()


def test_a_users_loss_from_a_file_trains_through_the_api(base):
    """``examples/parts/clipped_loss.py:clipped`` by name, its declared ``clip`` checked."""
    spec = f"{Path(__file__).resolve().parents[2]}/examples/parts/clipped_loss.py:clipped"
    policy = base.policy(rlpost.LoRA(rank=2))
    prompt, out = rollout(policy, base)
    data = as_data(prompt, out, [1.0, -1.0, 0.5, -0.5])
    fb = policy.forward_backward(data, spec, clip=0.1)
    assert fb.stats["clip"] == pytest.approx(0.1)
    assert policy.optim_step(lr=1e-2)["grad_norm"] > 0
    with pytest.raises(APIError, match="loss params"):
        policy.forward_backward(data, spec, clip="wide")
    policy.close()
