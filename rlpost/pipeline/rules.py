"""The rule table: every rule that relates two or more config fields, in one place.

A rule is a named function of the whole config returning one line, ``key=value: reason; fix``, or
None when the config passes. ``rlpost.config`` checks each value on its own; what holds between
fields, or between a field and a registered name's traits, is checked here only, and builders,
engines and the sync layer trust it. Every command that loads a config runs :func:`check`, so
``rlpost config X`` cannot call valid what ``rlpost train X`` refuses; ``rlpost config`` checks as
the command named by ``--for`` (default :func:`command_for`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

from rlpost.algos import POLICY_LOSSES
from rlpost.algos.probe import CONTRACTS, probe
from rlpost.config import (
    AgentConfig,
    Config,
    ConfigError,
    EvalSetConfig,
    FileTaskConfig,
    PrefsTaskConfig,
    ReasoningGymConfig,
    SourceConfig,
)
from rlpost.envs.base import EnvError
from rlpost.envs.catalog import env_factory
from rlpost.envs.formats import TagFormat
from rlpost.pipeline.build import run_device
from rlpost.registry import UnknownNameError
from rlpost.resolved import ENGINES, RunFacts, resolve
from rlpost.rewards.scorer import check_terms

COMMANDS = ("train", "sft", "eval", "dpo", "rm")
RL = ("train", "sft", "eval")  # the commands that sample prompts (not preference pairs)


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[..., str | None]  # (cfg, f=None): f() gives the resolved facts
    commands: tuple[str, ...]


RULES: list[Rule] = []
"""The table, in the order it is checked (the first problem found is the one reported)."""


def rule(*commands: str):
    """Add the decorated function to the table, for ``commands`` (default: every command). It
    returns its line, or anything false when the config passes (``return bad and (line)``); the
    table's ``check`` returns the line or None. A rule of two arguments is given the config's
    :class:`RunFacts` second, resolved once for the table (when its first such rule runs)."""

    def add(fn: Callable[..., str | bool | None]):
        two = fn.__code__.co_argcount == 2

        def check(cfg: Config, f=None) -> str | None:
            return (fn(cfg, (f or partial(resolve, cfg))()) if two else fn(cfg)) or None

        RULES.append(Rule(fn.__name__, check, commands or COMMANDS))
        return fn

    return add


def problems(cfg: Config, command: str = "train") -> list[str]:
    """Every rule of ``command`` that ``cfg`` breaks, one line each, in table order."""
    return list(_lines(cfg, command))


def check(cfg: Config, command: str = "train") -> Config:
    """``cfg`` when it passes every rule of ``command``; else ConfigError with the first line."""
    if (line := next(_lines(cfg, command), None)) is not None:
        raise ConfigError(line)
    return cfg


def _lines(cfg: Config, command: str) -> Iterator[str]:
    f = cache(partial(resolve, cfg))
    return (line for r in RULES if command in r.commands if (line := r.check(cfg, f)))


def command_for(cfg: Config) -> str:
    """The command a config is checked as when none is named (``rlpost config``)."""
    if cfg.sft.data != "task":
        return "sft"
    return "dpo" if isinstance(cfg.data.task, PrefsTaskConfig) else "train"


@rule("train")
def algorithm_parts_resolve(cfg: Config) -> str | bool | None:
    # First: the rules after it read the parts' traits. A choice's built-in name is checked by
    # its union; user code gets one dummy call.
    a = cfg.algo
    for key, kind, part in (
        ("algo.advantage.name", "advantage", a.advantage),
        ("algo.loss.name", "loss", a.loss),
        ("algo.kl.estimator", "kl", a.kl.estimator),
        ("algo.loss_agg_mode", "aggregation", a.loss_agg_mode),
        ("algo.rollout_correction.name", "correction", a.rollout_correction),
    ):
        name = getattr(part, "name", part)
        try:
            if ":" in name:
                problem = probe(kind, name, part)
            else:
                problem = isinstance(part, str) and CONTRACTS[kind][0].get(name) and None
        except (UnknownNameError, ValueError) as exc:
            problem = str(exc)
        if problem:
            return f"config {key}={name}: {problem}"
    return None


@rule("train")
def micro_batch_fits_mini_batch(cfg: Config) -> str | bool | None:
    t = cfg.train
    return t.micro_batch_size > t.mini_batch_size and (
        f"train.micro_batch_size={t.micro_batch_size} is larger than "
        f"train.mini_batch_size={t.mini_batch_size}; set micro_batch_size <= mini_batch_size"
    )


@rule("train")
def mini_batch_fits_rollout_batch(cfg: Config) -> str | bool | None:
    return cfg.train.mini_batch_size > cfg.batch_size and (
        f"train.mini_batch_size={cfg.train.mini_batch_size} is larger than the rollout batch "
        f"(rollout.prompts_per_step * rollout.n = {cfg.batch_size}); lower it or raise the batch"
    )


@rule("train")
def group_relative_needs_groups(cfg: Config, f: RunFacts) -> str | bool | None:
    a = cfg.algo.advantage.name
    return (cfg.rollout.n == 1 and f.group_relative) and (
        f"rollout.n=1 gives every {a} group zero advantage; set rollout.n >= 2 "
        "or use algo.advantage=reinforce_pp with algo.loss=flash_reinforce"
    )


@rule(*RL)
def prompts_not_pairs(cfg: Config) -> str | bool | None:
    return isinstance(cfg.data.task, PrefsTaskConfig) and (
        "data.task=prefs holds preference pairs, for rlpost dpo; rlpost train needs prompts "
        "(data.task=arith, code, file, reasoning_gym or verifiers)"
    )


def _file_path_problem(cfg: Config, path: str, what: str) -> str | None:
    t = cfg.data.task
    return (
        isinstance(t, FileTaskConfig) and not cfg.data.sources and not getattr(t, path)
    ) and f"data.task.{path}=None: data.task=file reads {what} from it; set it"


@rule("train", "sft", "dpo", "rm")
def file_task_needs_train_path(cfg: Config) -> str | bool | None:
    return _file_path_problem(cfg, "train_path", "its rows (prompts, or pairs for dpo and rm)")


@rule("eval")
def file_task_needs_eval_path(cfg: Config) -> str | bool | None:
    return _file_path_problem(cfg, "eval_path", "the rows it evaluates")


@rule("dpo", "rm")
def pairs_not_prompts(cfg: Config) -> str | bool | None:
    return not isinstance(cfg.data.task, PrefsTaskConfig | FileTaskConfig) and (
        f"rlpost dpo and rlpost rm train on preference pairs: data.task={cfg.data.task.name} "
        "has none; use data.task=prefs (the built-in pairs) or data.task=file with a pairs file"
    )


@rule()
def tiny_context_fits_max_tokens(cfg: Config) -> str | bool | None:
    tiny, r = cfg.model.tiny, cfg.rollout
    return (cfg.model.path is None and r.max_tokens + 32 > tiny.max_position_embeddings) and (
        f"rollout.max_tokens={r.max_tokens} leaves no room for the prompt within "
        f"model.tiny.max_position_embeddings={tiny.max_position_embeddings}; "
        "raise max_position_embeddings or lower max_tokens"
    )


@rule(*RL)
def remote_needs_servers(cfg: Config) -> str | bool | None:
    return (cfg.rollout.engine.name == "remote" and not cfg.rollout.engine.servers) and (
        "rollout.engine=remote needs rollout.engine.servers; start servers with `rlpost serve` and "
        "list their URLs"
    )


@rule("train")
def on_policy_servers_take_weights(cfg: Config) -> str | bool | None:
    e = cfg.rollout.engine
    return (e.name == "remote" and e.server == "openai") and (
        "rollout.engine.server=openai: an endpoint that cannot take weights would sample "
        "from a policy that never changes; serve with rlpost serve (server=rlpost) or "
        "vllm serve (server=vllm), or use it with rlpost eval"
    )


@rule("train")
def vllm_server_takes_plain_weights(cfg: Config) -> str | bool | None:
    s, e = cfg.sync, cfg.rollout.engine
    return (e.name == "remote" and e.server == "vllm" and s.codec.name != "none") and (
        f"sync.codec={s.codec.name} with rollout.engine.server=vllm: vllm serve loads a plain "
        "weight file; set sync.codec=none"
    )


@rule(*RL)
def vllm_needs_model_path(cfg: Config) -> str | bool | None:
    if cfg.rollout.engine.name == "vllm" and cfg.model.path is None:
        return (
            "rollout.engine=vllm needs model.path: vLLM loads a checkpoint directory; set "
            "model.path to a local HF checkpoint or use rollout.engine=hf"
        )
    path = cfg.model.path
    gguf = path is not None and (str(path).endswith(".gguf") or _holds_gguf(path))
    return (cfg.rollout.engine.name == "vllm" and gguf) and (
        f"model.path={path}: vLLM would serve the GGUF's quantized weights while the trainer "
        f"trains dequantized ones; convert it once (rlpost export {path} --out DIR) and set "
        "model.path=DIR, or use rollout.engine=hf"
    )


def _holds_gguf(path) -> bool:
    p = Path(path)
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


@rule("train")
def partial_needs_sync_mode(cfg: Config) -> str | bool | None:
    mode = cfg.pipeline.mode
    return (cfg.rollout.partial and mode != "sync") and (
        f"rollout.partial=true with pipeline.mode={mode}: the overlapped loop already keeps "
        "rollout running across steps; set rollout.partial=false or pipeline.mode=sync"
    )


@rule("train", "eval")
def batch_engine_runs_whole_batches(cfg: Config, f: RunFacts) -> str | bool | None:
    """An engine that decodes whole batches cannot stop a partial step early, take weights
    while it generates (async) or serve a harness's sessions: refused, never swapped."""
    async_ = cfg.pipeline.mode == "async"
    asked = ("rollout.partial=true", cfg.rollout.partial), ("pipeline.mode=async", async_)
    needs = [k for k, on in (*asked, ("agent.harness", cfg.agent.harness.name != "none")) if on]
    if not needs or not ENGINES.trait(f.engine, "whole_batches"):  # auto picks one that stops
        return None
    return (
        f"rollout.engine={f.engine} with {needs[0]}: the batch engine decodes whole batches; use "
        "rollout.engine=hf_continuous (or auto, which picks it)"
    )


@rule("train")
def rollout_logprobs_need_full_distribution(cfg: Config) -> str | bool | None:
    r = cfg.rollout
    return (cfg.algo.old_logprobs == "rollout" and (r.top_p < 1.0 or r.top_k > 0)) and (
        f"algo.old_logprobs=rollout with rollout.top_p={r.top_p:g}, rollout.top_k={r.top_k}: "
        "the engine's logprobs are of the truncated distribution, not the policy's; sample "
        "with top_p=1 and top_k=-1 or set algo.old_logprobs=trainer"
    )


@rule("train")
def rollout_logprobs_need_no_correction(cfg: Config) -> str | bool | None:
    a = cfg.algo
    if a.old_logprobs != "rollout":
        return None
    corr, tis_cap, loss = a.rollout_correction.name, a.loss.params().get("tis_cap"), a.loss.name
    one = {
        f"algo.rollout_correction.name={corr}": corr != "none",
        f"algo.loss.tis_cap={tis_cap}": tis_cap is not None,
        f"algo.loss.name={loss}": POLICY_LOSSES.trait(loss, "corrects_rollout"),
    }
    key = next((k for k, bad in one.items() if bad), None)
    return key and (
        f"algo.old_logprobs=rollout with {key}: the ratio is already against the engine's "
        "logprobs, so the engine/trainer weight is always 1; use algo.old_logprobs=trainer"
    )


@rule("train")
def rollout_logprobs_need_trainer_numbers(cfg: Config, f: RunFacts) -> str | bool | None:
    if cfg.algo.old_logprobs != "rollout":
        return None
    if f.bf16:  # bfloat16, or auto on a CPU with native bf16
        on = " (bf16 on this CPU)" if cfg.model.dtype == "auto" else ""
        key = f"model.dtype={cfg.model.dtype}{on}"
    elif cfg.sync.codec.name != "none":
        key = f"sync.codec={cfg.sync.codec.name}"
    else:
        return None
    return (
        f"algo.old_logprobs=rollout with {key}: the engine serves other numbers than the "
        "trainer's, so its logprobs are not the policy's; use algo.old_logprobs=trainer"
    )


@rule("train")
def component_estimator_needs_outcome_rewards(cfg: Config, f: RunFacts) -> str | bool | None:
    a = cfg.algo
    why = "algo.kl.placement=reward" if a.kl.placement == "reward" else "agent.env"
    per_token = why != "agent.env" or cfg.agent.env.name != "none"  # rewards beside the outcome
    return (per_token and f.plan.components) and (
        f"algo.advantage={a.advantage.name} with {why}: it normalises the reward terms' outcome "
        "scores and would drop the per-token rewards (the KL penalty, an environment's turn "
        "rewards); use another estimator or algo.kl.placement=loss"
    )


@rule(*RL)
def reward_terms_resolve(cfg: Config) -> str | bool | None:
    return _terms_problem(cfg, "config reward.terms", cfg.reward.terms)


def _terms_problem(cfg: Config, key: str, terms: list) -> str | None:
    """Why reward ``terms`` (at ``key``: reward.terms, a source's or an eval set's own) do not
    resolve."""
    try:
        check_terms(cfg.reward.model_copy(update={"terms": terms}))
    except (UnknownNameError, ValueError) as exc:
        return f"{key}: {exc}"
    return None


@rule(*RL)
def agent_env_resolves(cfg: Config) -> str | bool | None:
    if (a := cfg.agent).env.name == "none":
        return None
    try:
        make_env = env_factory(a.env.name, a.env.params())
        if a.format == "tags":  # (the other formats need the tokenizer: checked when built)
            TagFormat(a.call_template, a.result_template).check(tuple(make_env().tools))
    except EnvError as exc:
        return f"config agent.env: {exc}"
    return None


@rule("train")
def sync_channel_is_wired(cfg: Config, f: RunFacts) -> str | bool | None:
    channel, remote = cfg.sync.channel.name, f.engine_over_http
    gloo = ("gloo",) if not remote and f.backend == "process" else ()
    if channel in (("http", "inprocess") if remote else ("inprocess", "disk", *gloo)):
        return None
    return (
        f"sync.channel={channel}: rlpost train sends weights in process (inprocess), through "
        "the run's weights/ directory to rollout workers (disk), over torch.distributed to a "
        "rollout worker process (gloo, with cluster.backend=process) or to rollout servers "
        "(http, with rollout.engine=remote); set one of those (vllm is for engines started "
        "outside the loop: docs/sync.md)"
    )


@rule("train")
def disk_channel_one_rollout_worker(cfg: Config) -> str | bool | None:
    n, channel = cfg.cluster.rollout_workers, cfg.sync.channel.name
    return (channel in ("disk", "gloo") and n > 1) and (
        f"sync.channel={channel} with cluster.rollout_workers={n}: a fleet readmits restarted "
        "workers from its own copy of the weights; set sync.channel=inprocess or "
        "cluster.rollout_workers=1"
    )


@rule("train")
def engine_logprobs_of_the_full_distribution(cfg: Config) -> str | bool | None:
    r, corr = cfg.rollout, cfg.algo.rollout_correction.name
    vllm = r.engine.name == "vllm" or getattr(r.engine, "server", None) == "vllm"
    return (vllm and (r.top_p < 1.0 or r.top_k > 0) and corr != "none") and (
        f"algo.rollout_correction.name={corr} with vLLM serving and "
        f"rollout.top_p={r.top_p:g}, rollout.top_k={r.top_k}: vLLM's logprobs are of the "
        "truncated distribution, so the correction's weights would depend on the engine; "
        "sample with top_p=1 and top_k=-1, or set algo.rollout_correction.name=none"
    )


@rule("train")
def delta_needs_acknowledging_readers(cfg: Config) -> str | bool | None:
    return (cfg.sync.delta and cfg.sync.channel.name == "disk") and (
        "sync.codec.delta=true with sync.channel=disk: disk readers cannot acknowledge a base "
        "version; use http, gloo or inprocess, or set sync.codec.delta=false"
    )


@rule("train")
def local_backend_one_worker_per_role(cfg: Config, f: RunFacts) -> str | bool | None:
    c = cfg.cluster
    return (f.backend == "local" and (c.rollout_workers > 1 or c.trainer_workers > 1)) and (
        f"cluster.rollout_workers={c.rollout_workers}, trainer_workers={c.trainer_workers} "
        "with cluster.backend=local: several workers of a role need processes of their own; "
        "set cluster.backend=process or cluster.backend=ray"
    )


@rule("train")
def reward_workers_need_ray(cfg: Config, f: RunFacts) -> str | bool | None:
    c = cfg.cluster
    return (c.reward_workers and f.backend != "ray") and (
        f"cluster.reward_workers={c.reward_workers} needs cluster.backend=ray "
        f"(backend={c.backend}); 0 scores in the driver"
    )


@rule("train")
def suspect_before_dead(cfg: Config) -> str | bool | None:
    c = cfg.cluster
    return c.suspect_after_s > c.dead_after_s and (
        f"cluster.suspect_after_s={c.suspect_after_s} is above "
        f"cluster.dead_after_s={c.dead_after_s}; a worker is suspect before it is dead"
    )


@rule("train")
def data_parallel_without_critic(cfg: Config, f: RunFacts) -> str | bool | None:
    n, a = cfg.cluster.trainer_workers, cfg.algo.advantage.name
    return (n > 1 and f.plan.values) and (
        f"cluster.trainer_workers={n}: the PPO critic (algo.advantage={a}) trains on one "
        "worker only; set cluster.trainer_workers=1"
    )


@rule("train")
def data_parallel_without_adapters(cfg: Config) -> str | bool | None:
    n, rank = cfg.cluster.trainer_workers, cfg.model.lora.rank
    return (n > 1 and rank > 0) and (
        f"cluster.trainer_workers={n} with model.lora.rank={rank}: adapters train on one "
        "worker only; set cluster.trainer_workers=1 or model.lora.rank=0"
    )


@rule("train")
def data_parallel_cuts_by_rows(cfg: Config) -> str | bool | None:
    n, budget = cfg.cluster.trainer_workers, cfg.train.max_tokens_per_micro_batch
    return (n > 1 and budget > 0) and (
        f"train.max_tokens_per_micro_batch={budget} with cluster.trainer_workers={n}: "
        "data-parallel ranks cut micro-batches by rows; set train.max_tokens_per_micro_batch=0"
    )


@rule("train")
def fleet_without_partial(cfg: Config) -> str | bool | None:
    n = cfg.cluster.rollout_workers
    return (n > 1 and cfg.rollout.partial) and (
        f"cluster.rollout_workers={n} with rollout.partial=true: carried groups live in one "
        "worker and would be lost with it; set rollout.partial=false or rollout_workers=1"
    )


@rule("train")
def fleet_not_over_remote(cfg: Config, f: RunFacts) -> str | bool | None:
    n = cfg.cluster.rollout_workers
    return (n > 1 and f.engine_over_http) and (
        f"cluster.rollout_workers={n} with rollout.engine=remote: the remote engine already "
        "balances over rollout.engine.servers; set cluster.rollout_workers=1"
    )


@rule()
def device_is_visible(cfg: Config, f: RunFacts) -> str | bool | None:
    if cfg.cluster.backend == "ray":  # Ray workers resolve the device where they run
        return None
    try:
        run_device(f)
    except ConfigError as exc:
        return str(exc)
    return None


@rule("train")
def no_inert_knobs(cfg: Config, f: RunFacts) -> str | bool | None:
    """A knob set away from its default where nothing reads it is refused, never ignored."""
    found = inert_knobs(cfg, f)
    return found[0] if found else None


def inert_knobs(cfg: Config, f: RunFacts) -> list[str]:
    """Every knob of ``cfg`` set away from its default that this config never reads."""
    out = []
    for section, prefix, fields, inert, fix in _inert_table(cfg, f):
        for field in fields:
            value, known = getattr(section, field), type(section).model_fields.get(field)
            moved = value != known.default if known else field in section.model_fields_set
            if inert and moved:  # (a user's part: its declared params, set in the config)
                out.append(f"{prefix}.{field}={value}: nothing reads it in this config; {fix}")
    return out


def unread_keys(cfg: Config) -> list[str]:
    """Keys (and sections, ``critic``) of parts ``cfg`` does not use: ``rlpost config --keys``
    leaves them out, so it lists the chosen parts' keys."""
    facts, m, a = resolve(cfg), cfg.model, cfg.agent
    ray, fleet = facts.backend == "ray", facts.backend != "local"
    table = [
        (not facts.plan.values, ["critic"]),
        (not m.teacher.path and not m.teacher.url, [f"model.teacher.{k}" for k in
         ("api_key", "timeout_s", "micro_batch_size")]),
        (m.lora.rank == 0, ["model.lora.alpha", "model.lora.dropout", "model.lora.target_modules"]),
        (a.env.name == a.harness.name == "none", [f"agent.{k}" for k in AgentConfig.model_fields
                                               if k not in ("env", "harness")]),
        (not ray, [f"cluster.{k}" for k in ("address", "reward_workers", "placement", "trainer",
                                            "rollout", "reward", "placement_timeout_s")]),
        (not fleet, [f"cluster.{k}" for k in ("start_timeout_s", "max_restarts", "suspect_after_s",
                                              "dead_after_s", "drain_timeout_s")]),
        (cfg.observe.prometheus.port is None, ["observe.prometheus.host"]),
        (cfg.sft.data != "file", [f"sft.{k}" for k in ("train_path", "eval_path", "eval_fraction",
                                                        "messages_field", "answer_field",
                                                        "last_turn_only")]),
    ]  # fmt: skip
    out = [key for unused, keys in table if unused for key in keys]
    inert = [(p, k) for _, p, k, unused, _ in _inert_table(cfg, facts) if unused]
    return out + [f"{prefix}.{field}" for prefix, fields in inert for field in fields]


def _inert_table(cfg: Config, f: RunFacts) -> list[tuple]:
    """(section, its key, fields, nothing reads them, the fix) of knobs that other knobs
    turn off; a loss declares its own (its ``read_when`` trait)."""
    a, r, s, w = cfg.algo, cfg.rollout, cfg.sync, cfg.reward
    copied = not f.engine_over_http and s.codec.name == "none"
    mixed = any(t.kind in ("model", "judge") for t in w.terms)
    rules = [  # (section, its key, fields, nothing reads them, the fix)
        (a.kl, "algo.kl", ("estimator", "placement", "target"), a.kl.beta == 0,
         "set algo.kl.beta > 0"),
        (a.kl, "algo.kl", ("horizon",), a.kl.target is None, "set algo.kl.target (adaptive KL)"),
        (a, "algo", ("max_sampling_rounds",), not a.dynamic_sampling,
         "set algo.dynamic_sampling=true"),
        (r, "rollout", ("partial_fraction",), not r.partial, "set rollout.partial=true"),
        (r, "rollout", ("partial_chunk_tokens",), not r.partial or f.engine_in_process,
         "it applies to a partial rollout on a remote or vllm engine"),
        (s, "sync", ("bucket_mb", "verify", "timeout_s"), copied,
         "weights are copied in process with sync.codec=none; set sync.codec to stream them"),
        (w, "reward", ("alpha",), not mixed,
         "alpha mixes verifiable with model or judge terms; add one"),
        (w, "reward", ("sample_count",), w.sample_every == 0, "set reward.sample_every > 0"),
        (s, "sync", ("bucket_mb", "verify"), getattr(r.engine, "server", None) == "vllm",
         "vllm serve loads one plain weight file per push"),
    ]  # fmt: skip
    if s.codec.name == "bf16":  # (the field is the bf16 codec's)
        fix = "set sync.codec.delta=true"
        rules.append((s.codec, "sync.codec", ("delta_full_threshold",), not s.delta, fix))
    for k, (knob, on) in POLICY_LOSSES.trait(a.loss.name, "read_when", {}).items():
        fix = f"set algo.loss.{knob}={str(on).lower()}"
        rules.append((a.loss, "algo.loss", (k,), getattr(a.loss, knob) != on, fix))
    return rules


@rule("sft")
def sft_file_needs_train_path(cfg: Config) -> str | bool | None:
    return (
        cfg.sft.data == "file" and not cfg.sft.train_path
    ) and "sft.data=file needs sft.train_path; set it to a JSONL or Parquet file of messages"


@rule("train", "dpo")
def conversations_are_for_rlpost_sft(cfg: Config) -> str | bool | None:
    return (cfg.sft.data != "task" and cfg.sft.steps > 0) and (
        f"sft.data={cfg.sft.data} trains on conversations with rlpost sft only; run rlpost sft "
        "first, then this command with model.path=RUN_DIR/sft_model sft.steps=0"
    )


def _listed_twice(names: list[str]) -> str | None:
    """The first (in sorted order) of the names listed more than once, or None."""
    return min((n for n in names if names.count(n) > 1), default=None)


def _sources(cfg: Config) -> list[tuple[str, SourceConfig]]:
    """Every source of prompts with its key: data's sources (``data`` for the one unnamed
    source), then the evaluation sets."""
    out = [(f"data.sources[{s.name}]" if s.name else "data", s) for s in cfg.data.prompt_sources]
    return out + [(f"eval.sets[{s.name}]", s) for s in cfg.eval.sets]


@rule()
def sources_named_once(cfg: Config) -> str | bool | None:
    for key, entries in (("data.sources", cfg.data.sources), ("eval.sets", cfg.eval.sets)):
        if (twice := _listed_twice([s.name for s in entries])) is not None:
            return (
                f"{key} name={twice}: two share the name (rows, rewards and metrics are told "
                "apart by it); give each its own name"
            )
    return None


@rule()
def sources_replace_one_source_keys(cfg: Config) -> str | bool | None:
    d = cfg.data
    if d.sources and d.task.name != "arith":  # the default: a recipe's base may name it
        return f"data.task={d.task.name}: data.sources replaces it; set task on each source"
    return (d.sources and d.prompt_template != "{prompt}") and (
        f"data.prompt_template={d.prompt_template}: data.sources replaces it; "
        "set prompt_template on each source"
    )


@rule()
def source_keys_fit_its_task(cfg: Config) -> str | bool | None:
    for key, s in _sources(cfg):
        line = _file_keys_problem(key, s) if isinstance(s.task, FileTaskConfig) else None
        if line is None and isinstance(s, EvalSetConfig) and s.weight != 1.0:
            line = f"{key}.weight={s.weight}: a set is not sampled for training; drop it"
        problem = _template_problem(s.prompt_template, s.task.name)
        if line is None and problem is not None:
            line = f"{key}.prompt_template={s.prompt_template}: {problem}"
        if line is not None:
            return line
    return None


def _file_keys_problem(key: str, s: SourceConfig) -> str | None:
    """Why a file task's paths do not fit its place: a source trains on train_path (a
    streamed one holds out by eval_path), a set reads only eval_path."""
    t, key = s.task, f"{key}.task"
    if isinstance(s, EvalSetConfig):
        if not t.eval_path:
            return f"{key}.eval_path=None: a file set reads its rows from it; set it"
        if t.train_path or t.stream:
            return f"{key}.train_path={t.train_path}: a set trains on nothing; drop it"
    elif s.name and not t.train_path:
        return f"{key}.train_path=None: a file source needs it; set it to its rows' file"
    elif t.stream and not (s.name and t.eval_path):
        what = "eval_path=None" if s.name else "the one unnamed source cannot stream"
        return (
            f"{key}.stream=true: {what}; a streamed file is a source of data.sources that "
            "holds out no rows itself, so name its held-out rows in eval_path (or drop stream)"
        )
    return None


def _template_problem(template: str, task: str) -> str | None:
    """Why ``template`` cannot format a row of ``task`` (one phrase and its fix), or None."""
    import string

    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f}
    except ValueError as exc:
        return f"not a format string ({exc}); escape braces as {{{{ and }}}}"
    reach = sorted(f for f in names if "." in f or "[" in f)
    if reach:
        return f"field {{{reach[0]}}} reaches into a value; name whole fields, e.g. {{prompt}}"
    if task != "file" and names - {"prompt"}:
        return f"names {sorted(names - {'prompt'})[0]!r}; task={task} rows have only {{prompt}}"
    return None


@rule(*RL)
def source_rewards_resolve(cfg: Config) -> str | bool | None:
    sources = {s.name for s in cfg.data.sources}
    for key, s in _sources(cfg):
        if s.reward is None:
            continue
        if isinstance(s, EvalSetConfig) and s.name in sources:
            return (
                f"{key}.reward: data.sources[{s.name}]'s terms score the set of its name; "
                "drop reward or rename the set"
            )
        if not s.reward:
            return f"{key}.reward=[]: no term scores it; add one or drop reward"
        if (line := _terms_problem(cfg, f"{key}.reward", s.reward)) is not None:
            return line
    return None


@rule()
def reasoning_gym_task_generates(cfg: Config) -> str | bool | None:
    from rlpost.data.reasoning_gym import task_problem

    for key, s in _sources(cfg):
        if not isinstance(s.task, ReasoningGymConfig):
            continue
        problem = task_problem(s.task) or _reasoning_gym_sandbox_problem(s.task)
        if problem is not None:
            return f"{key}.task.task={s.task.task}: {problem}"
    return None


def _reasoning_gym_sandbox_problem(c: ReasoningGymConfig) -> str | None:
    """Why a task whose scorer evaluates text as code is not scored here, or None."""
    from rlpost.rewards.reasoning_gym import evaluating_refused
    from rlpost.rewards.reasoning_gym_sandbox import sandbox_problem
    from rlpost.rewards.reasoning_gym_scan import task_evaluates

    calls = task_evaluates(c.task)
    if calls and not c.evaluate_answers:
        return evaluating_refused(calls)
    if not calls or (problem := sandbox_problem()) is None:
        return None
    return (
        f"its scorer evaluates the answer as code ({', '.join(calls[:3])}), which rlpost runs "
        f"only in the sandbox, and {problem}"
    )


@rule("train", "eval")
def eval_set_metrics_known(cfg: Config) -> str | bool | None:
    from rlpost.algos.eval_metrics import parse_metric

    for s in cfg.eval.sets:
        key = f"eval.sets[{s.name}].metrics"
        if not s.metrics:
            return f"{key}=[]: a set measures something; list e.g. mean@8, pass@8, maj@8, greedy"
        for m in s.metrics:
            try:
                parse_metric(m)
            except ValueError as exc:
                return f"{key}={m}: {exc}; write e.g. pass@8"
        if (twice := _listed_twice(s.metrics)) is not None:
            return f"{key}={twice}: listed twice (one key each); list it once"
    return None


@rule("train", "eval")
def eval_set_k_within_samples(cfg: Config) -> str | bool | None:
    for s in cfg.eval.sets:
        for m in s.metrics:
            if "@" in m and m.split("@", 1)[1].isdigit() and int(m.split("@", 1)[1]) > s.n:
                return (
                    f"eval.sets[{s.name}].samples={s.n}: {m} needs at least "
                    f"{m.split('@', 1)[1]} samples per problem; raise samples or lower k"
                )
    return None


@rule("rm")
def rm_margin_needs_a_file(cfg: Config) -> str | bool | None:
    margin = cfg.rm.margin_field if cfg.rm is not None else None
    return (margin is not None and not isinstance(cfg.data.task, FileTaskConfig)) and (
        f"rm.margin_field={margin}: data.task={cfg.data.task.name} has no columns; "
        "drop it or use data.task=file with a pairs file that has the column"
    )


@rule("train", "eval")
def agent_harness_runs(cfg: Config) -> str | bool | None:
    """An outside agent (agent.harness) runs on the in-process continuous engine or on remote
    rlpost servers (sessions over their admin routes), alone."""
    h = cfg.agent.harness
    if h.name == "none":
        return None
    if cfg.agent.env.name != "none":
        return f"agent.env={cfg.agent.env.name}: agent.harness runs the episodes; drop one of them"
    if cfg.rollout.engine.name == "vllm":
        return (
            "rollout.engine=vllm: agent.harness records sessions on the run's in-process "
            "engine or on rlpost servers; use rollout.engine=auto or remote"
        )
    if cfg.rollout.engine.name == "remote" and cfg.rollout.engine.server != "rlpost":
        return (
            f"rollout.engine.server={cfg.rollout.engine.server}: agent.harness records "
            "sessions on rlpost servers only; set rollout.engine.server=rlpost"
        )
    if cfg.rollout.engine.name == "remote" and h.chat_template is not None:
        return (
            "agent.harness.chat_template: remote servers render chats with their own "
            "tokenizer's template; drop it or use rollout.engine=auto"
        )
    if cfg.rollout.partial:
        return "rollout.partial=true: harness sessions never carry across steps; set it false"
    if cfg.cluster.backend in ("process", "ray"):
        return (
            f"cluster.backend={cfg.cluster.backend}: agent.harness runs in this process; use local"
        )
    from rlpost.rollout.serve.tool_parsers import TOOL_PARSERS

    if h.tool_parser not in TOOL_PARSERS:
        return f"agent.harness.tool_parser={h.tool_parser}: unknown; valid: {', '.join(sorted(TOOL_PARSERS))}"
    return None


@rule("train")
def distillation_has_one_teacher(cfg: Config, f: RunFacts) -> str | bool | None:
    t = cfg.model.teacher
    if t.path and t.url:
        return (
            f"model.teacher.url={t.url}: model.teacher.path={t.path} names a teacher too; "
            "set one of them"
        )
    uses = "algo.advantage=on_policy_distill or algo.loss=gkd"
    if f.plan.reads_teacher and not (t.path or t.url):
        name = cfg.algo.loss.name if f.plan.teacher_logits else cfg.algo.advantage.name
        return (
            f"model.teacher.path=None: {name} distils from a teacher; set model.teacher.path "
            "(a trained run's checkpoints/step_N/model) or model.teacher.url"
        )
    if t.path and not (Path(t.path).is_dir() or Path(t.path).suffix == ".gguf"):
        return (
            f"model.teacher.path={t.path}: not a directory or a .gguf file; point it at a "
            "model directory or a .gguf file"
        )
    if (t.path or t.url) and not f.plan.reads_teacher:
        key = "path" if t.path else "url"
        return f"model.teacher.{key}={t.path or t.url}: no part of the run reads it; set {uses}"
    return None


@rule("train")
def gkd_needs_local_teacher(cfg: Config, f: RunFacts) -> str | bool | None:
    return (f.plan.teacher_logits and cfg.model.teacher.url) and (
        f"model.teacher.url={cfg.model.teacher.url}: algo.loss.name={cfg.algo.loss.name} "
        "needs the teacher's full logits, which a server does not return; use "
        "model.teacher.path (in-process) or algo.advantage=on_policy_distill"
    )


@rule("train")
def distillation_weights_not_both_zero(cfg: Config, f: RunFacts) -> str | bool | None:
    for on, key in ((f.plan.teacher, "advantage"), (f.plan.teacher_logits, "loss")):
        p = getattr(cfg.algo, key).params()
        if on and p.get("distill_weight") == 0 and p.get("task_weight") == 0:
            return (
                f"algo.{key}.distill_weight=0: task_weight is 0 too, so nothing trains; "
                "raise either"
            )
    return None
