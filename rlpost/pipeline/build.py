"""Builders: the only code that reads the whole config tree and turns it into parts.

Everything downstream receives the fields it needs (STYLE rule 7). Names are
resolved against the registries here, so an unknown estimator, loss, KL
estimator, aggregation mode or reward fails before any work starts.
"""

from __future__ import annotations

import copy
import inspect
import os

import torch

from rlpost.algos import (
    ADVANTAGES,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_aggregation,
    get_kl_estimator,
    get_policy_loss,
)
from rlpost.algos.correction import get_correction
from rlpost.config import Config, ConfigError
from rlpost.data import DataError, LoadReport, arith_splits, load_prompt_file
from rlpost.data.code import code_splits
from rlpost.data.render import prepare_prompts
from rlpost.envs.base import EnvError
from rlpost.envs.catalog import env_factory
from rlpost.envs.formats import TagFormat, build_format, demonstration_completion
from rlpost.models.loading import context_length, frozen_copy, load_policy, load_tokenizer
from rlpost.models.tiny import build_char_tokenizer
from rlpost.observe.mfu import cpu_bf16_native
from rlpost.registry import UnknownNameError
from rlpost.rewards.scorer import build_scorer, check_terms
from rlpost.rewards.worker import RewardWorker
from rlpost.rollout.continuous import ContinuousEngine
from rlpost.rollout.hf_engine import HFEngine
from rlpost.rollout.longtail import LengthPredictor, PartialRollout
from rlpost.rollout.multiturn import MultiTurnRollout
from rlpost.rollout.prefix_cache import PrefixCache
from rlpost.rollout.protocol import SamplingParams
from rlpost.rollout.scheduler import Scheduler
from rlpost.rollout.worker import RolloutWorker
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.dp import DPSpec
from rlpost.train.worker import TrainerWorker
from rlpost.types import Prompt


def check_names(cfg: Config) -> None:
    """Resolve every registered name and parameter; raise ConfigError naming the key.

    Parameter values were checked by the typed config at load; here each one set
    is checked to be a parameter of the estimator or loss chosen, and the
    registered traits are checked against the rest of the config.
    """
    a = cfg.algo
    checks = [
        ("algo.advantage", a.advantage, get_advantage_estimator, a.advantage_params.given()),
        ("algo.policy_loss", a.policy_loss, get_policy_loss, a.loss_params.given()),
        ("algo.kl.estimator", a.kl.estimator, get_kl_estimator, {}),
        ("algo.loss_agg_mode", a.loss_agg_mode, get_aggregation, {}),
    ]
    if a.rollout_correction.name != "none":
        checks.append(
            ("algo.rollout_correction.name", a.rollout_correction.name, get_correction, {})
        )
    for key, name, lookup, params in checks:
        try:
            fn = lookup(name)
        except UnknownNameError as exc:
            raise ConfigError(f"config {key}={name!r}: {exc}") from None
        _check_params(key, name, fn, params)
    if cfg.rollout.n == 1 and ADVANTAGES.trait(a.advantage, "group_relative"):
        raise ConfigError(
            f"rollout.n=1 gives every {a.advantage} group zero advantage; set rollout.n >= 2 "
            "or use algo.advantage=reinforce_pp with algo.policy_loss=flash_reinforce"
        )
    if cfg.sync.channel not in ("inprocess", "http") or (
        cfg.sync.channel == "http" and cfg.rollout.engine != "remote"
    ):
        raise ConfigError(
            f"sync.channel={cfg.sync.channel}: the training loop sends weights in process "
            "(sync.channel=inprocess) or to rollout servers over http (rollout.engine=remote); "
            "disk, gloo and vllm channels are for engines started outside the loop (docs/sync.md)"
        )
    try:
        check_terms(cfg.reward)
    except (UnknownNameError, ValueError) as exc:
        raise ConfigError(f"config reward.terms: {exc}") from None
    if cfg.agent.env is not None:
        try:
            make_env = env_factory(cfg.agent.env, cfg.agent.params)
            if cfg.agent.format == "tags":  # (the other formats need the tokenizer)
                tags = TagFormat(cfg.agent.call_template, cfg.agent.result_template)
                tags.check(tuple(make_env().tools))
        except EnvError as exc:
            raise ConfigError(f"config agent.env: {exc}") from None
    if a.old_logprobs == "rollout" and bf16_compute(cfg):  # model.dtype=auto, resolved here
        raise ConfigError(
            f"algo.old_logprobs=rollout with model.dtype={cfg.model.dtype} (bf16 on this CPU): "
            "the engine's bf16 logprobs are not the trainer's; use algo.old_logprobs=trainer "
            "or model.dtype=float32"
        )
    if ADVANTAGES.trait(a.advantage, "needs_components") and (
        a.kl.placement == "reward" or cfg.agent.env is not None
    ):
        why = "algo.kl.placement=reward" if a.kl.placement == "reward" else "agent.env"
        raise ConfigError(
            f"algo.advantage={a.advantage} with {why}: it normalises the reward terms' "
            "outcome scores and would drop the per-token rewards (the KL penalty, an "
            "environment's turn rewards); use another estimator or algo.kl.placement=loss"
        )
    check_data_parallel(cfg)
    if cfg.cluster.backend != "ray":  # Ray workers resolve the device where they run
        run_device(cfg)


def run_device(cfg: Config, rank: int | None = None) -> torch.device:
    """The device of ``run.device`` in this process (``auto``: cuda when torch sees a GPU);
    ``rank``: a data-parallel rank, which takes the GPU of its local rank."""
    name = cfg.run.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "config run.device=cuda: torch sees no GPU here (torch.cuda.is_available() is "
            "False); use run.device=cpu or auto"
        )
    if rank is None:
        return torch.device("cuda")  # the current GPU; no CUDA context is made here
    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


# Keyword parameters every estimator or loss takes from the caller, not from the config.
_CALLER_PARAMS = {
    "values",
    "agg",
    "rollout_logprobs",
    "ref_logprobs",
    "selected",
    "components",
    "baseline_scores",
    "old_logprobs",
    "sum_pi_squared",
}


def _check_params(key: str, name: str, fn, params: dict) -> None:
    if not params:
        return
    sig = inspect.signature(fn)
    valid = [
        p.name
        for p in sig.parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in _CALLER_PARAMS
    ]
    section = "advantage_params" if key == "algo.advantage" else "loss_params"
    for param in params:
        if param not in valid:
            raise ConfigError(
                f"config algo.{section}.{param}: {name} takes no parameter {param!r}; "
                f"valid: {', '.join(valid) or 'none'}"
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
    elif d.task == "prefs":
        raise ConfigError(
            "data.task=prefs holds preference pairs, for rlpost dpo; rlpost train needs prompts "
            "(data.task=arith, code or file)"
        )
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


def bf16_compute(cfg: Config) -> bool:
    """``model.dtype`` resolved: bfloat16, or auto on a CPU with native bf16 instructions (or
    a GPU run on a GPU that computes in bf16)."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype == "bfloat16"
    if cfg.run.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_native()


def serves_policy_storage(cfg: Config) -> bool:
    """Whether the in-process engine can serve the policy's own parameter memory instead of
    a copy. It can when it always serves exactly the trainer's newest weights, so every sync
    writes into that memory the values already there (``copy_`` onto itself is a no-op):
    synchronous steps (the engine idle while the trainer updates), a sync every step, no
    codec or delta (decoded weights would overwrite the trainer's), no adapters (the merged
    weights are not the base weights), fp32 serving (bf16 serving is its own cast copy),
    the batch engine (a partial rollout keeps generating across a sync)."""
    s = cfg.sync
    return (
        cfg.pipeline.mode == "sync"
        and s.every == 1
        and s.codec == "none"
        and not s.delta
        and cfg.model.lora.rank == 0
        and not cfg.rollout.partial
        and not bf16_compute(cfg)
    )


def build_engine(cfg: Config, model, tokenizer, *, push: bool = True):
    """The rollout engine, serving ``model``'s current weights (later ones arrive through sync).

    ``push=False``: a remote or vLLM engine is left as its servers loaded it (the
    caller sends the weights itself)."""
    r = cfg.rollout
    if r.engine in ("vllm", "remote"):
        if r.engine == "vllm":
            from rlpost.rollout import vllm_engine as module  # lazy: vLLM is a GPU extra
        else:
            from rlpost.rollout import remote_engine as module
        engine = module.build(cfg, tokenizer)
        if push:
            # Servers load from disk: push the starting policy (after warm-up) first.
            engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), version=0)
        return engine
    if serves_policy_storage(cfg):
        # The serving module shares the policy's parameter storage: no second copy of the
        # weights in the process (docs/performance.md, Memory). Its own Parameter objects
        # (no grad, eval mode) over the same memory; buffers are copied.
        shared = {
            id(p): torch.nn.Parameter(p.detach(), requires_grad=False) for p in model.parameters()
        }
        serving = copy.deepcopy(model, shared)
    else:
        serving = copy.deepcopy(model)
    serving.requires_grad_(False)
    if bf16_compute(cfg):
        serving = serving.to(dtype=torch.bfloat16)
    serving.to(run_device(cfg))
    if r.partial or cfg.pipeline.mode == "async":
        # Continuous batching lets a partial step stop the moment enough samples are done,
        # and takes new weights between decode steps while it generates (overlapped modes).
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


def sampling_params(cfg: Config, eos_token_id: int) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=r.max_tokens,
        stop_token_ids=(eos_token_id,),
    )


def eval_params(cfg: Config, eos_token_id: int, *, greedy: bool = False) -> SamplingParams:
    """Held-out sampling: its own seed, so an evaluation never shifts the training samples."""
    return SamplingParams(
        temperature=0.0 if greedy else cfg.eval.temperature,
        max_tokens=cfg.rollout.max_tokens,
        stop_token_ids=(eos_token_id,),
        seed=cfg.run.seed + 10_007,
    )


def build_trainer(cfg: Config, model, dp=None) -> PolicyTrainer:
    """The policy trainer; with ``dp`` (a :class:`rlpost.train.dp.DataParallel`) the policy
    and the reference are sharded with FSDP2 before the optimizer sees them."""
    a, t, c = cfg.algo, cfg.train, cfg.algo.rollout_correction
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
        nll_coef=a.nll_coef,
        kl_in_loss=a.kl.placement == "loss",
        bf16=bf16_compute(cfg),
        logits_chunk=t.logits_chunk_tokens,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        loss_params=a.loss_params.given(),
        correction_params={"cap": c.cap, "low": c.low, "high": c.high},
    )
    keep_ref = a.kl.beta > 0 or POLICY_LOSSES.trait(a.policy_loss, "needs_reference")
    lora = cfg.model.lora.rank > 0
    if settings.bf16 and eager_attention_pays(model):
        model.set_attn_implementation("eager")
    ref = frozen_copy(model) if keep_ref and not lora else None
    reference = None
    if keep_ref and lora:
        from rlpost.models.lora import reference_mode

        reference = lambda: reference_mode(model)  # noqa: E731
    if dp is not None:
        from rlpost.train.dp import shard_model

        bf16 = bf16_compute(cfg)
        shard_model(model, bf16=bf16)
        if ref is not None:
            shard_model(ref, bf16=bf16, trainable=False)
    return PolicyTrainer(
        model,
        get_policy_loss(a.policy_loss),
        settings,
        ref_model=ref,
        kl_estimator=get_kl_estimator(a.kl.estimator),
        correction=None if c.name == "none" else get_correction(c.name),
        reference=reference,
        token_selector=POLICY_LOSSES.trait(a.policy_loss, "token_selector", None),
        seed=cfg.run.seed,
        dp=dp,
    )


EAGER_ATTENTION_MAX_POSITIONS = 512


def eager_attention_pays(model) -> bool:
    """Whether the trainer should run the eager attention rather than sdpa under bf16.

    On CPU, torch's sdpa backward under bf16 autocast is slow at the short sequences of
    RL on small models: eager attention made a bf16 forward+backward 1.34x faster at
    ~25M and 1.44x at the tiny size (128 rows x 16 tokens, docs/performance.md); in
    fp32 the two are even. Eager keeps a ``[B, heads, L, L]`` score tensor per layer
    for the backward, so it is used only where the context is short.
    """
    positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return positions <= EAGER_ATTENTION_MAX_POSITIONS and hasattr(model, "set_attn_implementation")


def build_critic(cfg: Config, model):
    """A critic trainer when the advantage estimator needs values (PPO), else None."""
    if not ADVANTAGES.trait(cfg.algo.advantage, "needs_critic"):
        return None
    from rlpost.train.critic import CriticTrainer, ValueModel

    c, t = cfg.critic, cfg.train
    return CriticTrainer(
        ValueModel.from_policy(model).to(run_device(cfg)),
        seed=cfg.run.seed,
        bf16=bf16_compute(cfg),
        lr=c.lr,
        warmup_steps=t.warmup_steps,
        grad_clip=t.grad_clip,
        mini_batch_size=t.mini_batch_size,
        micro_batch_size=t.micro_batch_size,
        epochs=c.epochs,
        clip_range=c.clip_range,
        loss_agg_mode=cfg.algo.loss_agg_mode,
    )


# ------------------------------------------------------------------ workers


def check_data_parallel(cfg: Config) -> None:
    """What sharded trainers do not cover yet is refused in one line before any work."""
    n = cfg.cluster.trainer_workers
    if n <= 1:
        return
    if ADVANTAGES.trait(cfg.algo.advantage, "needs_critic"):
        raise ConfigError(
            f"cluster.trainer_workers={n}: the PPO critic (algo.advantage={cfg.algo.advantage}) "
            "trains on one worker only; set cluster.trainer_workers=1"
        )
    if cfg.model.lora.rank > 0:
        raise ConfigError(
            f"cluster.trainer_workers={n} with model.lora.rank={cfg.model.lora.rank}: adapters "
            "train on one worker only; set cluster.trainer_workers=1 or model.lora.rank=0"
        )
    budget = cfg.train.max_tokens_per_micro_batch
    if budget > 0:
        raise ConfigError(
            f"train.max_tokens_per_micro_batch={budget} with cluster.trainer_workers={n}: "
            "data-parallel ranks cut micro-batches by rows; set train.max_tokens_per_micro_batch=0"
        )


def build_trainer_worker(cfg: Config, model, tokenizer, dp: DPSpec | None = None) -> TrainerWorker:
    """The trainer worker around ``model`` (the starting policy, after any warm-up); with
    ``model.lora.rank > 0`` the model gets adapters and only they train.

    ``dp``: this worker is rank ``dp.rank`` of ``dp.world`` data-parallel trainers; it joins
    their process group here (blocking until all have joined) and shards its modules."""
    if dp is not None:
        check_data_parallel(cfg)
        device = run_device(cfg, dp.rank)
        if dp.backend != ("nccl" if device.type == "cuda" else "gloo"):
            raise ConfigError(
                f"data-parallel trainers over {dp.backend} with run.device={cfg.run.device} "
                f"({device.type} here): use gloo on cpu and nccl on cuda"
            )
        model.to(device)
        from rlpost.train.dp import DataParallel, init_group

        init_group(dp, timeout_s=cfg.cluster.start_timeout_s)
        group = DataParallel(dp, device=device)
        return TrainerWorker(build_trainer(cfg, model, group), tokenizer, dp=group)
    model.to(run_device(cfg))
    critic = build_critic(cfg, model)
    lora = cfg.model.lora
    if lora.rank > 0:
        from rlpost.models.lora import LoRASettings, apply_lora

        settings = LoRASettings(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))
        model = apply_lora(model, settings)
    return TrainerWorker(build_trainer(cfg, model), tokenizer, critic=critic, lora=lora.rank > 0)


def build_rollout_worker(cfg: Config, model=None, tokenizer=None) -> RolloutWorker:
    """The rollout worker. Without ``model`` it builds its own copy of the policy's shape
    (the weights arrive from the trainer through ``load_weights`` before the first rollout);
    the global random state is left as it was, so building here changes no other stream."""
    own = model is None
    if own:
        with torch.random.fork_rng(devices=[]):
            model, tokenizer = build_policy(cfg)
    r = cfg.rollout
    engine = build_engine(cfg, model, tokenizer, push=not own)
    partial = None
    if r.partial:
        partial = PartialRollout(
            engine,
            fraction=r.partial_fraction,
            chunk_tokens=r.partial_chunk_tokens,
            tokenizer=tokenizer,
        )
    lengths = LengthPredictor() if r.length_aware else None
    return RolloutWorker(
        engine,
        tokenizer,
        partial=partial,
        lengths=lengths,
        batch_size=r.batch_size,
        agent=build_agent(cfg, engine, tokenizer),
    )


def build_agent(cfg: Config, engine, tokenizer) -> MultiTurnRollout | None:
    """The episode runner over ``engine`` when ``agent.env`` is set (None: single turn)."""
    a = cfg.agent
    if a.env is None:
        return None
    try:
        make_env = env_factory(a.env, a.params)
        fmt = agent_format(cfg, tokenizer)
        fmt.check(tuple(make_env().tools))
    except EnvError as exc:
        raise ConfigError(f"config agent: {exc}") from None
    return MultiTurnRollout(
        engine,
        tokenizer,
        env=make_env,
        max_turns=a.max_turns,
        max_tool_tokens=a.max_tool_tokens,
        max_output_chars=a.max_output_chars,
        fmt=fmt,
        workers=a.workers,
    )


def agent_format(cfg: Config, tokenizer):
    """The call format of ``agent.format`` for this tokenizer and prompt rendering."""
    a = cfg.agent
    chat = cfg.data.chat_template == "auto"
    return build_format(
        a.format, tokenizer, call=a.call_template, result=a.result_template, chat_prompts=chat
    )


def agent_demonstrations(cfg: Config, tokenizer):
    """The warm-up's example builder for multi-turn episodes (None without ``agent.env``):
    the environment's demonstration in the run's call format, its tool output masked;
    ``agent.sft_direct`` of them answer without calling a tool."""
    a = cfg.agent
    if a.env is None:
        return None
    make_env = env_factory(a.env, a.params)
    fmt = agent_format(cfg, tokenizer)

    def example(prompt: Prompt, rng):
        direct = rng.random() < a.sft_direct
        return demonstration_completion(make_env(), prompt, fmt, tokenizer, rng, direct=direct)

    return example


def build_reward_worker(cfg: Config) -> RewardWorker:
    scorer = build_scorer(cfg.reward, truncated_reward=cfg.rollout.truncated_reward)
    return RewardWorker(scorer, max_tokens=cfg.rollout.max_tokens)
