"""Builders: the only code that reads the whole config tree and turns it into parts.

Everything downstream receives the fields it needs (STYLE rule 7). Names are
resolved against the registries here, so an unknown estimator, loss, KL
estimator, aggregation mode or reward fails before any work starts.
"""

from __future__ import annotations

import copy
import inspect

import torch

from rlpost.algos import get_advantage_estimator, get_aggregation, get_kl_estimator, get_policy_loss
from rlpost.config import Config, ConfigError
from rlpost.data import DataError, LoadReport, arith_splits, load_prompt_file
from rlpost.data.code import code_splits
from rlpost.data.render import prepare_prompts
from rlpost.models.loading import context_length, frozen_copy, load_policy, load_tokenizer
from rlpost.models.tiny import build_char_tokenizer
from rlpost.registry import UnknownNameError
from rlpost.rewards.scorer import build_scorer
from rlpost.rollout.hf_engine import HFEngine
from rlpost.rollout.longtail import ContinuousEngine
from rlpost.rollout.prefix_cache import PrefixCache
from rlpost.rollout.protocol import SamplingParams
from rlpost.rollout.scheduler import Scheduler
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.types import Prompt


def check_names(cfg: Config) -> None:
    """Resolve every registered name and keyword parameter; raise ConfigError naming the key."""
    a = cfg.algo
    checks = [
        ("algo.advantage", a.advantage, get_advantage_estimator, a.advantage_params),
        ("algo.policy_loss", a.policy_loss, get_policy_loss, a.loss_params),
        ("algo.kl.estimator", a.kl.estimator, get_kl_estimator, {}),
        ("algo.loss_agg_mode", a.loss_agg_mode, get_aggregation, {}),
    ]
    for key, name, lookup, params in checks:
        try:
            fn = lookup(name)
        except UnknownNameError as exc:
            raise ConfigError(f"config {key}={name!r}: {exc}") from None
        _check_params(key, name, fn, params)
    try:
        build_scorer(cfg.reward)
    except (UnknownNameError, ValueError) as exc:
        raise ConfigError(f"config reward.terms: {exc}") from None


def _check_params(key: str, name: str, fn, params: dict) -> None:
    if not params:
        return
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    for param in params:
        if (
            param not in sig.parameters
            or sig.parameters[param].kind is not inspect.Parameter.KEYWORD_ONLY
        ):
            valid = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
            raise ConfigError(
                f"config {key.rsplit('.', 1)[0]}.{'advantage_params' if 'advantage' in key else 'loss_params'}"
                f".{param}: {name} takes no parameter {param!r}; valid: {', '.join(valid)}"
            )


def build_data(cfg: Config) -> tuple[list[Prompt], list[Prompt], dict[str, int]]:
    """(train prompts, held-out prompts, load counts: rows used and skipped by reason)."""
    train, held_out, reports = load_data(cfg)
    counts = reports["train"].counts("train")
    return train, held_out, counts | (reports["eval"].counts("eval") if held_out else {})


def load_data(cfg: Config) -> tuple[list[Prompt], list[Prompt], dict[str, LoadReport]]:
    """(train prompts, held-out prompts, {"train": report, "eval": report})."""
    d = cfg.data
    reports = {"train": LoadReport(), "eval": LoadReport()}
    if d.task == "arith":
        try:
            train, held_out = arith_splits(
                d.arith.max_operand, d.arith.ops, d.arith.train_size, d.arith.eval_size
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for p in train + held_out:
            p.text = d.prompt_template.format(prompt=p.text)
    elif d.task == "code":
        try:
            train, held_out = code_splits(d.code.train_size, d.code.eval_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    else:
        kwargs = dict(
            prompt_field=d.prompt_field,
            answer_field=d.answer_field,
            on_bad_row=d.on_bad_row,
            template=d.prompt_template,
        )
        train, held_out = [], []
        if d.train_path:  # (evaluation alone needs only eval_path)
            train, reports["train"] = load_prompt_file(d.train_path, **kwargs)
        if d.eval_path:
            held_out, reports["eval"] = load_prompt_file(d.eval_path, **kwargs)
    train = fit_to_model(cfg, train, reports["train"])
    held_out = fit_to_model(cfg, held_out, reports["eval"])
    if not train and reports["train"].problems:
        raise DataError(f"no training prompt fits the model ({reports['train'].first_problem})")
    return train, held_out, reports


def fit_to_model(cfg: Config, prompts: list[Prompt], report: LoadReport) -> list[Prompt]:
    """Prompts rendered for the model (chat template, system prompt), those too long for its
    context refused or skipped and counted; rollout.max_tokens must leave room for a prompt."""
    if cfg.model.path is None:
        tokenizer, limit = build_char_tokenizer(), cfg.model.tiny.max_position_embeddings
        source = "model.tiny.max_position_embeddings"
    else:
        tokenizer, limit = load_tokenizer(cfg.model.path), context_length(cfg.model.path)
        source = f"max_position_embeddings in {cfg.model.path}/config.json"
    budget = None if limit is None else limit - cfg.rollout.max_tokens
    if budget is not None and budget < 1:
        raise ConfigError(
            f"rollout.max_tokens={cfg.rollout.max_tokens} leaves no room for a prompt in the "
            f"model's {limit} positions ({source}); lower rollout.max_tokens well below {limit}"
        )
    return prepare_prompts(
        prompts,
        tokenizer,
        max_prompt_tokens=budget if budget is not None else 2**62,
        budget_note=f"with rollout.max_tokens={cfg.rollout.max_tokens} the model's {limit} "
        f"positions ({source}) leave {budget}; shorten it or lower rollout.max_tokens",
        on_bad_row=cfg.data.on_bad_row,
        report=report,
        chat_template=cfg.data.chat_template,
        system_prompt=cfg.data.system_prompt,
    )


def build_policy(cfg: Config):
    """(policy model, tokenizer) from ``model.path`` or the built-in tiny model."""
    model, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed, dtype="float32"
    )
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model, tokenizer


def build_engine(cfg: Config, model, tokenizer):
    """The rollout engine, serving ``model``'s current weights (later ones arrive through sync)."""
    r = cfg.rollout
    if r.engine in ("vllm", "remote"):
        if r.engine == "vllm":
            from rlpost.rollout import vllm_engine as module  # lazy: vLLM is a GPU extra
        else:
            from rlpost.rollout import remote_engine as module
        engine = module.build(cfg, tokenizer)
        # Servers load from disk: push the starting policy (after warm-up) before the first rollout.
        engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), version=0)
        return engine
    serving = copy.deepcopy(model)
    serving.requires_grad_(False)
    if cfg.model.dtype == "bfloat16":
        serving = serving.to(dtype=torch.bfloat16)
    if r.partial:
        # Continuous batching lets a partial step stop the moment enough samples are done.
        scheduler = Scheduler(
            serving,
            tokenizer,
            max_batch=r.batch_size,
            prefix_cache=PrefixCache(),
            seed=cfg.run.seed,
        )
        return ContinuousEngine(scheduler.start(), tokenizer)
    return HFEngine(
        serving, tokenizer, batch_size=r.batch_size, share_prefix=r.share_prefix, seed=cfg.run.seed
    )


def sampling_params(cfg: Config, tokenizer) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=r.max_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
    )


def eval_params(cfg: Config, tokenizer, *, greedy: bool = False) -> SamplingParams:
    """Held-out sampling: its own seed, so an evaluation never shifts the training samples."""
    return SamplingParams(
        temperature=0.0 if greedy else cfg.eval.temperature,
        max_tokens=cfg.rollout.max_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=cfg.run.seed + 10_007,
    )


def build_trainer(cfg: Config, model) -> PolicyTrainer:
    a, t = cfg.algo, cfg.train
    settings = ActorSettings(
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        betas=tuple(t.betas),
        grad_clip=t.grad_clip,
        mini_batch_size=t.mini_batch_size,
        micro_batch_size=t.micro_batch_size,
        epochs=t.epochs,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        loss_agg_mode=a.loss_agg_mode,
        norm_constant=float(cfg.rollout.max_tokens),
        entropy_coef=a.entropy_coef,
        kl_in_loss=a.kl.placement == "loss",
        bf16=cfg.model.dtype == "bfloat16",
        loss_params=dict(a.loss_params),
    )
    ref = frozen_copy(model) if a.kl.beta > 0 else None
    return PolicyTrainer(
        model,
        get_policy_loss(a.policy_loss),
        settings,
        ref_model=ref,
        kl_estimator=get_kl_estimator(a.kl.estimator),
        seed=cfg.run.seed,
    )


CRITIC_ESTIMATORS = ("gae", "vapo_gae")


def build_critic(cfg: Config, model):
    """A critic trainer when the advantage estimator needs values (PPO), else None."""
    if cfg.algo.advantage not in CRITIC_ESTIMATORS:
        return None
    from rlpost.train.critic import CriticTrainer, ValueModel

    c, t = cfg.critic, cfg.train
    return CriticTrainer(
        ValueModel.from_policy(model),
        seed=cfg.run.seed,
        bf16=cfg.model.dtype == "bfloat16",
        lr=c.lr,
        warmup_steps=t.warmup_steps,
        grad_clip=t.grad_clip,
        mini_batch_size=t.mini_batch_size,
        micro_batch_size=t.micro_batch_size,
        epochs=c.epochs,
        clip_range=c.clip_range,
        loss_agg_mode=cfg.algo.loss_agg_mode,
    )
