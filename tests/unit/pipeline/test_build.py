"""Builders and config checks: what is built, how often, and what the traits decide (CPU)."""

from __future__ import annotations

import math

import pytest

from rlpost.config import load_config
from rlpost.pipeline.build import build_reward_worker
from rlpost.pipeline.rules import check as check_names
from rlpost.types import Completion, Group, Prompt


class CountingScorer:
    """A batched reward that counts how often it is built (a reward model would load weights)."""

    built = 0

    def __init__(self, bonus: float = 0.0) -> None:
        type(self).built += 1
        self.bonus = bonus

    def score(self, samples):
        return [1.0 + self.bonus for _ in samples]

    def close(self) -> None:
        """Nothing to release (a real reward model would free its weights here)."""


def test_config_check_never_builds_a_batched_reward():
    name = f"{__name__}:CountingScorer"
    cfg = load_config(None, [f'reward.terms=[{{"name": "{name}", "kind": "model"}}]'])
    CountingScorer.built = 0
    check_names(cfg)
    assert CountingScorer.built == 0  # checked by name and parameters only
    worker = build_reward_worker(cfg)
    assert CountingScorer.built == 1
    worker.close()


def test_truncated_reward_is_applied_in_the_scorer_and_logged_as_trained():
    cfg = load_config(None, ["rollout.truncated_reward=-1.0"])
    worker = build_reward_worker(cfg)
    done = Completion([1], [5, 2], [0.0, 0.0], "stop", 0, 0, text="4")
    cut = Completion([1], [5, 5], [0.0, 0.0], "length", 0, 0, text="4")
    (group,) = worker.score([Group(Prompt("2+2=", answer=4), [done, cut])])
    assert group.scores == [1.0, -1.0]
    assert group.components["numeric_match"][0] == 1.0
    assert math.isnan(group.components["numeric_match"][1])  # the term did not score it
    assert math.isnan(group.components["truncated"][0]) and group.components["truncated"][1] == -1.0
    assert group.invalid == [False, False]


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_in_bf16(monkeypatch, native):
    import torch

    from rlpost import resolved
    from rlpost.config import load_config
    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
    from rlpost.pipeline import build

    monkeypatch.setattr(resolved, "cpu_bf16_native", lambda: native)
    cfg = load_config(None, ["model.dtype=auto"])
    assert resolved.resolve(cfg).bf16 is native
    tok = build_char_tokenizer()
    engine = build.build_engine(cfg, build_tiny_model(tok), tok)
    want = torch.bfloat16 if native else torch.float32
    layer = engine.model.model.layers[0]  # bf16 matrices; the norms and embedding stay float32
    assert layer.mlp.down_proj.weight.dtype == want
    assert layer.input_layernorm.weight.dtype == engine.model.lm_head.weight.dtype == torch.float32
    assert build.build_trainer(cfg, build_tiny_model(tok)).s.bf16 is native
    for fixed, bf16 in (("float32", False), ("bfloat16", True)):
        assert resolved.resolve(load_config(None, [f"model.dtype={fixed}"])).bf16 is bf16


def test_bf16_trainer_runs_eager_attention_on_short_contexts_only():
    from rlpost.config import load_config
    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
    from rlpost.pipeline import build

    tok = build_char_tokenizer()
    for dtype, positions, want in (
        ("bfloat16", 128, "eager"),
        ("float32", 128, "sdpa"),  # fp32: sdpa is as fast, results stay as recorded
        ("bfloat16", 4096, "sdpa"),  # long context: no [L, L] scores kept per layer
    ):
        model = build_tiny_model(tok, max_position_embeddings=positions)
        cfg = load_config(None, [f"model.dtype={dtype}"])
        trainer = build.build_trainer(cfg, model)
        assert trainer.model.config._attn_implementation == want, (dtype, positions)
        assert trainer.layout.ref.config._attn_implementation == want


@pytest.mark.parametrize(
    ("overrides", "shares"),
    [
        ([], True),
        (["sync.codec=bf16"], False),  # decoded weights must not land in the trainer's memory
        (["sync.every=2"], False),  # the engine serves an older version between syncs
        (["pipeline.mode=one_step_off"], False),  # it generates while the trainer updates
        (["model.lora.rank=4"], False),  # merged weights are not the base weights
        (["model.dtype=bfloat16"], False),  # bf16 serving is its own cast copy
    ],
)
def test_engine_serves_the_policy_memory_only_when_every_sync_writes_the_same_values(
    overrides, shares
):
    import torch

    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
    from rlpost.pipeline.build import build_engine

    cfg = load_config(None, overrides)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok)
    engine = build_engine(cfg, model, tok)
    served = dict(engine.model.named_parameters())
    for name, p in model.named_parameters():
        assert (served[name].data_ptr() == p.data_ptr()) is shares, name
        assert not served[name].requires_grad and p.requires_grad  # the policy still trains
    # A trainer step lands where the engine reads it; a sync then changes nothing.
    name, p = next(iter(model.named_parameters()))
    before = served[name].detach().clone()
    with torch.no_grad():
        p.add_(1.0)
    engine.load_weights([(name, p.detach())], version=1)
    assert torch.equal(served[name].float(), p.detach().to(served[name].dtype).float())
    assert p.data_ptr() != served[name].data_ptr() or torch.equal(p.detach(), before + 1.0)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"algo.kl.placement": "reward"}, "algo.kl.placement=reward"),
        ({"agent.env": "calc"}, "agent.env"),
    ],
)
def test_gdpo_refuses_what_would_drop_per_token_rewards(tmp_path, extra, named):
    from rlpost.config import ConfigError

    over = {"algo.advantage": "gdpo", **extra}
    cfg = load_config(None, [f"run.output_dir={tmp_path}", *[f"{k}={v}" for k, v in over.items()]])
    with pytest.raises(ConfigError) as err:
        check_names(cfg)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_rollout_logprobs_refuse_bf16_that_auto_resolves_to(tmp_path, monkeypatch):
    from rlpost import resolved
    from rlpost.config import ConfigError

    cfg = load_config(
        None, [f"run.output_dir={tmp_path}", "algo.old_logprobs=rollout", "model.dtype=auto"]
    )
    monkeypatch.setattr(resolved, "cpu_bf16_native", lambda: False)
    check_names(cfg)  # fp32 here: accepted
    monkeypatch.setattr(resolved, "cpu_bf16_native", lambda: True)
    with pytest.raises(ConfigError, match=r"model\.dtype=auto"):
        check_names(cfg)


@pytest.mark.parametrize("task", ["arith", "code"])
def test_a_built_in_task_formats_each_prompt_with_the_template(task):
    from rlpost.pipeline.build import load_data as load_prompts

    plain = load_prompts(load_config(None, [f"data.task={task}"]))
    cfg = load_config(None, [f"data.task={task}", "data.prompt_template=Task: {prompt}"])
    train, held_out, _ = load_prompts(cfg)
    assert [p.text for p in train + held_out] == [f"Task: {p.text}" for p in plain[0] + plain[1]]


def test_auto_lr_scales_the_policys_rate_to_its_size_and_adapters():
    from rlpost.config import load_config
    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model
    from rlpost.pipeline import build
    from rlpost.train.actor import size_scaled_lr

    # 7B at the 1e-6 GRPO runs settle on, SmolLM2-135M at the 2e-5 it learned fastest at
    # in 20 steps (docs/models.md), LoRA a decade up
    assert size_scaled_lr(7_000_000_000) == 1e-6
    assert size_scaled_lr(134_515_008) == 2e-5
    assert size_scaled_lr(134_515_008, adapters=True) == 2e-4
    assert size_scaled_lr(494_000_000) > size_scaled_lr(1_540_000_000) > 1e-6
    tok = build_char_tokenizer()
    model = build_tiny_model(tok)
    size = sum(p.numel() for p in model.parameters())
    trainer = build.build_trainer(load_config(None, ["train.optim.lr=auto"]), model)
    assert trainer.s.optim.lr == size_scaled_lr(size)
    fixed = build.build_trainer(load_config(None, ["train.optim.lr=3e-5"]), build_tiny_model(tok))
    assert fixed.s.optim.lr == 3e-5
