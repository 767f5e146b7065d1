"""Builders: the only code that reads the whole config tree and turns it into parts.

Everything downstream receives the fields it needs (STYLE rule 7). Names are
resolved against the registries here, so an unknown estimator, loss, KL
estimator, aggregation mode or reward fails before any work starts.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from functools import partial

import torch

from rlpost.algos import (
    get_kl_estimator,
)
from rlpost.config import Config, ConfigError, SourceConfig
from rlpost.data import DataError, LoadReport
from rlpost.data.files import prompt_file_keywords
from rlpost.data.render import prepare_prompts
from rlpost.data.sources import load_source
from rlpost.data.stream import preflight as stream_preflight
from rlpost.data.tasks import Splits
from rlpost.envs.base import EnvError
from rlpost.envs.catalog import env_factory
from rlpost.envs.formats import build_format, demonstration_completion
from rlpost.errors import one_line
from rlpost.models.loading import (
    checkpointing,
    context_length,
    frozen_copy,
    load_policy,
    load_tokenizer,
)
from rlpost.models.tiny import build_char_tokenizer
from rlpost.observe.memory import release_free_heap
from rlpost.pipeline.weights import build_weight_path
from rlpost.registry import import_callable
from rlpost.resolved import ENGINES, RunFacts, resolve
from rlpost.rewards.routing import build_routed_scorer
from rlpost.rewards.scorer import RewardWorker
from rlpost.rng import derive
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.episodes.multiturn import MultiTurnRollout
from rlpost.rollout.longtail import LengthPredictor, PartialRollout
from rlpost.rollout.worker import RolloutWorker
from rlpost.train.actor import ActorSettings, PolicyTrainer, eager_attention_pays, size_scaled_lr
from rlpost.train.dp import DPSpec
from rlpost.train.worker import TrainerWorker, WeightsExport
from rlpost.types import Prompt


def run_device(facts: RunFacts, rank: int | None = None) -> torch.device:
    """The device of the run in this process; ``rank``: a data-parallel rank, which takes
    the GPU of its local rank."""
    if facts.device == "cpu":
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


def build_data(cfg: Config) -> tuple[list[Prompt], list[Prompt], dict[str, int]]:
    """(train prompts, held-out prompts, load counts: rows used and skipped by reason)."""
    train, held_out, reports = load_data(cfg)
    counts = reports["train"].counts("train")
    return train, held_out, counts | (reports["eval"].counts("eval") if held_out else {})


def load_data(cfg: Config) -> tuple[list[Prompt], list[Prompt], dict[str, LoadReport]]:
    """(train prompts, held-out prompts, {"train": report, "eval": report}); with
    eval.sets, the held-out prompts are the sets' rows (each tagged with its set's name)."""
    train, held_out, reports = load_sources(cfg)
    if cfg.eval.sets:
        held_out, reports["eval"] = load_eval_sets(cfg, train)
    return train, held_out, reports


def fit_to_model(
    cfg: Config,
    prompts: list[Prompt],
    report: LoadReport,
    *,
    system_prompt: str | None = None,
    tokenizer=None,
) -> list[Prompt]:
    """Prompts rendered for the model (chat template, system prompt: ``system_prompt`` or
    data.system_prompt), those too long for its context refused or skipped and counted;
    rollout.max_tokens must leave room for a prompt. ``tokenizer``: the model's, if loaded."""
    tokenizer = tokenizer or run_tokenizer(cfg)
    if cfg.model.path is None:
        limit, source = cfg.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    else:
        limit = context_length(cfg.model.path)
        source = f"the context length {cfg.model.path} states"
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
        system_prompt=system_prompt or cfg.data.system_prompt,
    )


def run_tokenizer(cfg: Config):
    """The tokenizer of ``model.path``, or the built-in tiny model's."""
    return build_char_tokenizer() if cfg.model.path is None else load_tokenizer(cfg.model.path)


def build_policy(cfg: Config):
    """(policy model, tokenizer) from ``model.path`` or the built-in tiny model."""
    model, tokenizer = load_policy(
        cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.run.seed, dtype="float32"
    )
    if cfg.model.gradient_checkpointing:
        checkpointing(model)
        model.config.use_cache = False
    return model, tokenizer


def build_engine(
    cfg: Config, model, tokenizer, *, push: bool = True, facts: RunFacts | None = None
):
    """The engine ``facts.engine`` names (``ENGINES``), serving ``model``'s current weights
    (later ones arrive through sync). ``push=False``: an engine that loads its own weights
    (vLLM, remote servers) is left as it loaded them (the caller sends them itself)."""
    facts = facts or resolve(cfg)
    engine = ENGINES.get(facts.engine)(cfg, facts, model, tokenizer)
    if push and not facts.engine_in_process and not facts.engine_over_http:
        # vLLM loads from disk: push the starting policy (after warm-up) first (servers over
        # http get it through the run's weight path: build_rollout_worker).
        engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), version=0)
    return engine


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
        seed=derive(cfg.run.seed, "eval"),
    )


def build_trainer(cfg: Config, model, dp=None, *, facts: RunFacts | None = None) -> PolicyTrainer:
    """The policy trainer; with ``dp`` (a :class:`rlpost.train.dp.DataParallel`) the policy
    and the reference are sharded with FSDP2 before the optimizer sees them."""
    facts = facts or resolve(cfg)
    a, t, c = cfg.algo, cfg.train, cfg.algo.rollout_correction
    lr = t.optim.lr
    if lr == "auto":
        lr = size_scaled_lr(sum(p.numel() for p in model.parameters()), facts.adapters)
    settings = ActorSettings(
        optim=t.optim.model_copy(update={"lr": lr}),
        mini_batch_size=t.mini_batch_size,
        micro_batch_size=t.micro_batch_size,
        epochs=t.epochs,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        loss_agg_mode=a.loss_agg_mode,
        norm_constant=float(cfg.rollout.max_tokens),
        entropy_coef=a.entropy_coef,
        nll_coef=a.nll_coef,
        bf16=facts.bf16,
        logits_chunk=t.logits_chunk_tokens,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        packing=t.packing,
        correction=c,
    )
    if settings.bf16 and eager_attention_pays(model):
        model.set_attn_implementation("eager")
    return PolicyTrainer(
        model,
        a.loss,
        settings,
        layout=build_layout(cfg, facts, model, dp),
        kl_estimator=get_kl_estimator(a.kl.estimator),
        seed=cfg.run.seed,
    )


def build_layout(cfg: Config, facts: RunFacts, model, dp=None):
    """The weights' layout, chosen once: pipeline stages over ``dp``'s mesh where it has
    them, sharded over ``dp``'s ranks (split over its mesh's tensor-parallel axis first
    where it has one), LoRA adapters (``model.lora.rank > 0``,
    ``model`` already wears them) or plain; with the reference the step plan asks for (a
    frozen copy, or the base with the adapters off)."""
    from rlpost.train.layout import LoRALayout, PlainLayout, ShardedLayout

    if facts.adapters:
        return LoRALayout(model, keep_reference=facts.plan.reference)
    ref = frozen_copy(model) if facts.reference_copy else None
    if dp is None:
        return PlainLayout(model, ref)
    if dp.mesh is not None and "pp" in dp.mesh.mesh_dim_names:
        from rlpost.train.pp import PipelineLayout

        return PipelineLayout(model, ref, dp, facts.bf16)
    from rlpost.train.dp import shard_model

    for module, trainable in [(model, True), (ref, False)][: 1 + (ref is not None)]:
        if dp.mesh is None:
            shard_model(module, bf16=facts.bf16, trainable=trainable)
            continue
        from rlpost.train.tp import parallelize

        parallelize(module, dp.mesh["tp"])
        if dp.world > 1:
            shard_model(module, bf16=facts.bf16, trainable=trainable, mesh=dp.mesh["dp"])
    release_free_heap()  # the whole weights each rank loaded, back to the system
    return ShardedLayout(model, ref, dp)


def build_critic(cfg: Config, facts: RunFacts, model):
    """A critic trainer when the advantage estimator needs values (PPO), else None."""
    if not facts.plan.values:
        return None
    from rlpost.train.critic import CriticTrainer, ValueModel

    c, t = cfg.critic, cfg.train
    return CriticTrainer(
        ValueModel.from_policy(model).to(run_device(facts)),
        seed=cfg.run.seed,
        bf16=facts.bf16,
        optim=c.optim,
        mini_batch_size=t.mini_batch_size,
        micro_batch_size=t.micro_batch_size,
        epochs=c.epochs,
        clip_range=c.clip_range,
        loss_agg_mode=cfg.algo.loss_agg_mode,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        packing=t.packing,
    )


def build_trainer_worker(
    cfg: Config, model, tokenizer, dp: DPSpec | None = None, *, facts: RunFacts | None = None
) -> TrainerWorker:
    """The trainer worker around ``model`` (the starting policy, after any warm-up); with
    ``model.lora.rank > 0`` the model gets adapters and only they train.

    ``dp``: this worker is rank ``dp.rank`` of ``dp.world`` trainers; it joins their process
    group here (blocking until all have joined) and shards its modules, over a
    ``(dp, tp)`` mesh under ``cluster.tensor_parallel > 1``."""
    facts = facts or resolve(cfg)
    if dp is not None:
        device = run_device(facts, dp.rank)
        if dp.backend != ("nccl" if device.type == "cuda" else "gloo"):
            raise ConfigError(
                f"data-parallel trainers over {dp.backend} with run.device={cfg.run.device} "
                f"({device.type} here): use gloo on cpu and nccl on cuda"
            )
        model.to(device)
        from rlpost.train import pp as stages
        from rlpost.train.dp import DataParallel, init_group
        from rlpost.train.tp import device_mesh, split_error

        layout = facts.layout
        why = split_error(model.config, layout.tp) or stages.split_error(model.config, layout.pp)
        if why is not None:
            raise ConfigError(why)
        init_group(dp, timeout_s=cfg.cluster.start_timeout_s)
        mesh = device_mesh(layout, device.type) if layout.split else None
        group = DataParallel(dp, device=device, mesh=mesh)
        trainer = build_trainer(cfg, model, group, facts=facts)
        return TrainerWorker(trainer, tokenizer, layout=trainer.layout)
    model.to(run_device(facts))
    critic = build_critic(cfg, facts, model)
    if facts.adapters:
        from rlpost.models.lora import LoRASettings, apply_lora

        lora = cfg.model.lora
        settings = LoRASettings(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))
        model = apply_lora(model, settings)
    trainer = build_trainer(cfg, model, facts=facts)
    return TrainerWorker(trainer, tokenizer, layout=trainer.layout, critic=critic)


def build_rollout_worker(
    cfg: Config, model=None, tokenizer=None, *, serve: bool = True, facts: RunFacts | None = None
) -> RolloutWorker:
    """The rollout worker. Without ``model`` it builds its own copy of the policy's shape
    (the weights arrive from the trainer through ``load_weights`` before the first rollout);
    the global random state is left as it was, so building here changes no other stream.
    ``serve=False``: remote servers are left as they loaded (the loop's weight path sends
    the starting weights itself)."""
    facts, own = facts or resolve(cfg), model is None
    if own:
        with torch.random.fork_rng(devices=[]):
            model, tokenizer = build_policy(cfg)
    r = cfg.rollout
    engine = build_engine(cfg, model, tokenizer, push=not own, facts=facts)
    partial = None
    if r.partial:
        partial = PartialRollout(
            engine,
            fraction=r.partial_fraction,
            chunk_tokens=r.partial_chunk_tokens,
            tokenizer=tokenizer,
        )
    lengths = LengthPredictor() if r.length_aware else None
    worker = RolloutWorker(
        engine,
        tokenizer,
        partial=partial,
        lengths=lengths,
        batch_size=r.batch_size,
        agent=build_agent(cfg, engine, tokenizer),
    )
    takes = getattr(r.engine, "server", None) != "openai"  # an endpoint serving its own model
    if facts.engine_over_http and serve and not own and takes:  # servers load from disk
        path = build_weight_path(cfg, worker)
        try:
            path.push(WeightsExport(0, [(n, p.detach()) for n, p in model.named_parameters()]))
        finally:
            path.close()
    return worker


def build_agent(cfg: Config, engine, tokenizer) -> MultiTurnRollout | None:
    """The episode runner over ``engine`` when ``agent.env`` is set (None: single turn)."""
    a = cfg.agent
    if a.harness.name != "none":
        return build_harness(cfg, engine, tokenizer)
    if a.env.name == "none":
        return None
    try:
        make_env = env_factory(a.env.name, a.env.params())
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
    if getattr((a := cfg.agent).harness, "demonstrations", None) is not None:
        return harness_demonstrations(cfg, tokenizer)
    if a.env.name == "none":
        return None
    make_env = env_factory(a.env.name, a.env.params())
    if not callable(getattr(make_env(), "demonstration", None)):
        why = "has no demonstration(): the warm-up teaches no tool use"
        print(f"rlpost: agent.env={a.env.name} {why}", file=sys.stderr)
    fmt = agent_format(cfg, tokenizer)

    def example(prompt: Prompt, rng):
        direct = rng.random() < a.sft_direct
        return demonstration_completion(make_env(), prompt, fmt, tokenizer, rng, direct=direct)

    return example


def build_reward_worker(cfg: Config) -> RewardWorker:
    truncated = cfg.rollout.truncated_reward
    sources = cfg.data.sources + [s for s in cfg.eval.sets if s.reward is not None]
    scorer = build_routed_scorer(cfg.reward, sources, truncated_reward=truncated)
    return RewardWorker(scorer, max_tokens=cfg.rollout.max_tokens)


def load_sources(cfg: Config) -> tuple[list[Prompt], list[Prompt], dict[str, LoadReport]]:
    """Every source of ``data.prompt_sources`` loaded, rendered with its own system prompt and
    fitted to the model; with named sources the reports sum them and keep each one's own
    (``LoadReport.sources``)."""
    reports = {"train": LoadReport(), "eval": LoadReport()}
    train, held_out = [], []
    for src in cfg.data.prompt_sources:
        where = f"data.sources[{src.name}]" if src.name else "data"
        got = _load_source(cfg, src, where)
        sp = src.system_prompt or got.system_prompt
        part = fit_to_model(cfg, got.train, got.train_report, system_prompt=sp)
        if getattr(src.task, "stream", False):  # read as the run draws; its first rows checked
            part = stream_preflight(stream_args(cfg, src), stream_fit(cfg, src))
        elif not part and (src.name or got.train_report.problems):  # eval alone needs no train
            raise DataError(
                f"{where}: no training prompt fits the model "
                f"({got.train_report.first_problem or 'no rows'})"
            )
        train += part
        held_out += fit_to_model(cfg, got.held_out, got.eval_report, system_prompt=sp)
        if not src.name:  # the one unnamed source: its reports are the run's
            return train, held_out, {"train": got.train_report, "eval": got.eval_report}
        reports["train"].add(src.name, got.train_report)
        reports["eval"].add(src.name, got.eval_report)
    return train, held_out, reports


def _load_source(cfg: Config, src: SourceConfig, where: str) -> Splits:
    """``load_source``; a bad setting (a ValueError other than DataError) is a ConfigError
    naming ``where`` (``data``, ``data.sources[x]`` or ``eval.sets[x]``) and the task's key."""
    try:
        return load_source(src, on_bad_row=cfg.data.on_bad_row)
    except DataError:
        raise
    except ValueError as exc:
        line = one_line(exc)
        sep = "." if re.match(r"\w+=", line) else ": "  # "eval_size=5 ..." names a task key
        raise ConfigError(f"{where}.task{sep}{line}") from None


def stream_args(cfg: Config, src: SourceConfig) -> dict:
    """A streamed source's reader settings (rlpost.data.stream.StreamSampler's keywords)."""
    return dict(
        path=src.task.train_path,
        name=src.name,
        **prompt_file_keywords(src.task, cfg.data.on_bad_row, src.prompt_template),
    )


def stream_fit(cfg: Config, src: SourceConfig):
    """A streamed source's row fitter: rendered and checked against the model's context,
    the tokenizer loaded once."""
    return partial(fit_to_model, cfg, system_prompt=src.system_prompt, tokenizer=run_tokenizer(cfg))


def load_eval_sets(cfg: Config, train: list[Prompt]) -> tuple[list[Prompt], LoadReport]:
    """``eval.sets``: each set's held-out rows through the source loader (a file set's
    ``eval_path``), tagged with the set's name, rendered and fitted to the model; the
    report sums the sets and says per set how many prompts are also training prompts."""
    report, out = LoadReport(), []
    trained = {p.text for p in train}
    for s in cfg.eval.sets:  # a set is its source's held-out rows (a file set's eval_path)
        got = _load_source(cfg, s, f"eval.sets[{s.name}]")
        part_report, sp = got.eval_report, s.system_prompt or got.system_prompt
        part = fit_to_model(cfg, got.held_out, part_report, system_prompt=sp)
        part = part[: cfg.eval.limit or None]
        if not part:
            raise DataError(
                f"eval.sets[{s.name}]: no held-out prompt fits the model "
                f"({part_report.first_problem or 'no rows'})"
            )
        part_report.rows = len(part)
        part_report.info = {
            **got.train_report.info,
            "in_train": sum(p.text in trained for p in part),
        }
        report.add(s.name, part_report)
        out += part
    return out, report


def build_harness(cfg: Config, engine, tokenizer):
    """The runner of ``agent.harness``: the outside agent against recorded sessions of a
    loopback OpenAI server over ``engine``'s scheduler."""
    from rlpost.rollout.episodes.agent_runner import AgentRunner, HarnessSettings
    from rlpost.rollout.serve.sessions import SessionBounds

    h = cfg.agent.harness
    command = h.name == "command"
    fn = None if command else import_callable(h.name, "config agent.harness.name", ConfigError)
    entry = fn and partial(fn, **h.params())
    bounds = SessionBounds(h.max_requests, cfg.rollout.max_tokens, h.max_seconds)
    settings = HarnessSettings(
        entry,
        tuple(h.command) if command else (),
        tuple(h.env) if command else (),
        bounds,
        h.workers,
        h.chat_template,
        h.tool_parser,
        own_user=command and h.user == "session",
    )
    if cfg.rollout.engine.name == "remote":  # sessions on the servers, over their admin routes
        from rlpost.rollout.engines.client import keys_from_env
        from rlpost.rollout.engines.remote_sessions import RemoteSessions

        keys = keys_from_env(cfg.rollout.engine.api_key_env, cfg.rollout.engine.admin_key_env)
        remote = RemoteSessions(list(cfg.rollout.engine.servers), keys["admin_key"])
        return AgentRunner(engine, tokenizer, settings, cfg.run.name, remote=remote)
    return AgentRunner(engine, tokenizer, settings, name=cfg.run.name)


def harness_demonstrations(cfg: Config, tokenizer):
    """The warm-up's example builder of ``agent.harness.demonstrations``: its conversations
    rendered by the served chat template, the assistant turns trained."""
    from rlpost.rollout.episodes.demonstrations import conversation_example

    h = cfg.agent.harness
    fn = import_callable(h.demonstrations, "config agent.harness.demonstrations", ConfigError)
    served = copy.copy(tokenizer)
    if h.chat_template is not None:
        served.chat_template = h.chat_template

    def example(prompt: Prompt, rng):
        convo = fn(prompt.text, prompt.answer, rng)
        return None if convo is None else conversation_example(served, convo)

    return example


def check_teacher(cfg: Config, facts: RunFacts) -> None:
    """Refuse a teacher the run could not use (missing, another tokenizer, a server that
    refuses) before the run directory is touched: only tokenizers are read."""
    if not facts.plan.reads_teacher:
        return
    from rlpost.train.teacher import check_teacher as check

    t = cfg.model.teacher
    check(t.path, t.url, run_tokenizer(cfg), api_key=t.api_key, timeout=t.timeout_s)


def build_teacher_worker(cfg: Config, facts: RunFacts, tokenizer=None):
    """The distillation teacher ``model.teacher`` names, checked against the student's
    tokenizer (``tokenizer``, else loaded from ``model.path``); None when the step plan
    reads no teacher."""
    if not facts.plan.reads_teacher:
        return None
    from rlpost.train.teacher import build_teacher

    t = cfg.model.teacher
    return build_teacher(
        t.path,
        t.url,
        tokenizer or run_tokenizer(cfg),
        api_key=t.api_key,
        timeout=t.timeout_s,
        micro_batch_size=t.micro_batch_size,
    )
