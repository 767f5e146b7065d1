"""Memory preflight: the configured step's peak estimated before any work, and refused in one
line, naming the key to change, when it cannot fit this machine.

The estimate adds what one process holds at the peak of a step (the trainer's backward):
the weights (float32 master), gradients and AdamW's two moments of the trainable
parameters, a frozen reference copy when one is kept, the in-process engine's serving copy
when it does not share the policy's memory, its KV cache for a rollout chunk, the
activations of one micro-batch (:func:`layer_activations`) and the LM head's logits (one
chunk, or the whole micro-batch unchunked), over the interpreter with torch and
transformers loaded; the model's shape comes from its config on the meta device.
``summary.json`` records the estimate beside the measured ``peak_rss_mib``.

Under a trainer layout (:class:`~rlpost.resolved.TrainerLayout`, dp x pp x tp) the
trainer's terms are one rank's: the decoder layers' matrices, the embedding and the LM
head (by vocabulary, with the head's chunk of logits) split T ways, everything
FSDP2-sharded over the data-parallel ranks, and the split matrices' activations 1/T;
under ``cluster.pipeline_parallel`` the largest stage's layers and their activations; the
machine must hold every rank it runs (:func:`ranks_here`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlpost.config import Config, ConfigError
from rlpost.observe.mfu import _usable_cores
from rlpost.resolved import resolve
from rlpost.train.actor import EAGER_ATTENTION_MAX_POSITIONS
from rlpost.train.lm_head import chunk_tokens, needs_chunks
from rlpost.train.tp import COLUMN, ROW, vocab_modules

MIB = 2**20
BASE_MIB = 450.0
"""Resident set of a process with torch and transformers imported (measured, docs)."""
PROMPT_TOKENS = 256
"""Prompt length assumed for the estimate when the data is not read yet (a bound, not a mean)."""


@dataclass
class MemoryEstimate:
    """MiB per term of the step's peak; ``total`` is their sum."""

    weights: float
    gradients: float
    optimizer: float
    reference: float
    engine: float
    kv_cache: float
    activations: float
    logits: float
    base: float = BASE_MIB

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    @property
    def trainer_rank(self) -> float:
        """A further trainer rank's process: the total less the engine's copy and KV cache."""
        return self.total - self.engine - self.kv_cache

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in asdict(self).items()} | {"total": round(self.total)}


def model_shape(cfg: Config) -> dict:
    """Parameter count and the shape fields of the configured model (meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlpost.models.loading import load_config
    from rlpost.models.tiny import build_char_tokenizer, build_tiny_model

    with torch.device("meta"):
        if cfg.model.path is None:
            model = build_tiny_model(build_char_tokenizer(), **cfg.model.tiny.model_dump())
        else:
            model = AutoModelForCausalLM.from_config(load_config(cfg.model.path))
    c = model.config
    heads, hidden = getattr(c, "num_attention_heads", 1), getattr(c, "hidden_size", 0)
    split, found = COLUMN + ROW, vocab_modules(model) or ()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        # what tensor parallelism splits: the decoder layers' attention and MLP matrices
        "split": sum(
            p.numel()
            for name, p in model.named_parameters()
            if name.rpartition(".")[0].endswith(split)
        ),
        # what tensor parallelism splits by vocabulary: the embedding and an untied head
        "vocab_split": sum(p.numel() for p in torch.nn.ModuleList(found).parameters()),
        # what pipeline stages split: the decoder layers
        "layer_params": sum(p.numel() for n, p in model.named_parameters() if ".layers." in n),
        "vocab": int(getattr(c, "vocab_size", 0)),
        "hidden": hidden,
        "layers": int(getattr(c, "num_hidden_layers", 1)),
        "heads": heads,
        "kv_dim": getattr(c, "num_key_value_heads", heads) * (hidden // max(1, heads)),
        "intermediate": int(getattr(c, "intermediate_size", None) or 4 * hidden),
        "positions": int(getattr(c, "max_position_embeddings", None) or 1 << 30),
    }


def layer_activations(
    shape: dict, rows: int, seq: int, width: int, *, eager: bool, tp: int = 1
) -> float:
    """Bytes a Llama layer saves for its backward: 11 h + 4 I values a token under sdpa (3 h
    per RMSNorm, q/k/v, the attention output twice, SwiGLU's 4 I), plus eager's scores. Under
    T-way tensor parallelism a rank saves its heads' 5 h and its 4 I / T; the norms' 6 h whole."""
    per_token = 6 * shape["hidden"] + (5 * shape["hidden"] + 4 * shape["intermediate"]) / tp
    per_token += 2.5 * shape["heads"] / tp * seq if eager else 0  # 5 a s bytes at 16 bits
    return rows * seq * per_token * width


def stage_share(cfg: Config, shape: dict) -> float:
    """The share of the decoder layers the largest pipeline stage holds (1 without stages)."""
    layers = max(1, shape["layers"])
    return -(-layers // resolve(cfg).layout.pp) / layers


def rank_params(cfg: Config, shape: dict) -> float:
    """Parameters one trainer rank holds: its pipeline stage's layers (the largest stage),
    of them and of the vocabulary-split embedding and head the split matrices' 1/T slice,
    and the rest whole; all of it 1/dp under FSDP2 (its layer-at-a-time gathers are not
    counted)."""
    layout, share = resolve(cfg).layout, stage_share(cfg, shape)
    tp, dp = layout.tp, layout.dp
    held = shape["params"] - shape.get("layer_params", 0) * (1 - share)
    split = shape["split"] * share + (shape.get("vocab_split", 0) if tp > 1 else 0)
    return (held - split + split / tp) / dp


def serving_bytes(shape: dict, width: int) -> int:
    """An in-process engine's copy: its layers' matrices ``width`` bytes an element, the
    embeddings and head float32 (a bf16 copy computes as the trainer's autocast does)."""
    return shape["layer_params"] * width + (shape["params"] - shape["layer_params"]) * 4


def ranks_here(cfg: Config) -> int:
    """Trainer ranks on this machine: all of them, unless they join a Ray cluster elsewhere."""
    facts = resolve(cfg)
    return 1 if facts.backend == "ray" and cfg.cluster.address else facts.layout.world


def estimate(cfg: Config, shape: dict) -> MemoryEstimate:
    """The step's peak by term (see the module docstring), the trainer's terms one rank's."""
    t, r, facts = cfg.train, cfg.rollout, resolve(cfg)
    width = 2 if facts.bf16 else 4
    n = rank_params(cfg, shape)
    trainable = 0.01 * n if facts.adapters else n  # adapters: a small fraction
    in_process = facts.engine_in_process  # a serving copy (unless shared) and a KV cache
    seq = PROMPT_TOKENS + r.max_tokens
    rows = min(r.batch_size, r.prompts_per_step * r.n)
    kv = rows * seq * shape["layers"] * 2 * shape["kv_dim"] * width if in_process else 0
    micro, budget = t.micro_batch_size, t.max_tokens_per_micro_batch
    micro = max(1, min(micro, budget // seq)) if budget > 0 else micro
    eager = facts.bf16 and shape["positions"] <= EAGER_ATTENTION_MAX_POSITIONS
    # float32's size under bf16 autocast too: it saves 0.7-0.8 of that, the backward adds
    layer = layer_activations(shape, micro, seq, 4, eager=eager, tp=facts.layout.tp)
    layers = round(shape["layers"] * stage_share(cfg, shape))  # the largest pipeline stage's
    activations = layers * layer
    if cfg.model.gradient_checkpointing:  # each layer's input, and one layer recomputed
        activations = layers * micro * seq * shape["hidden"] * 4 + layer  # float32 residuals
    tokens = micro * r.max_tokens
    if facts.plan.teacher_logits:
        # gkd reads whole distributions, past the chunked head: the student's logits, their
        # float32 copy and gradient, the teacher's logits and the divergence's two log-softmaxes
        logits = 6 * tokens * shape["vocab"] * 4
    elif needs_chunks(tokens, shape["vocab"], t.logits_chunk_tokens) and t.logits_chunk_tokens >= 0:
        logits = 4 * chunk_tokens(shape["vocab"], t.logits_chunk_tokens) * shape["vocab"] * 4
        logits /= facts.layout.tp  # a rank's rows of a vocabulary-split head
    else:  # the full logits, their float32 copy and the gradient
        logits = 3 * tokens * shape["vocab"] * 4
    return MemoryEstimate(
        weights=n * 4 / MIB,
        gradients=trainable * 4 / MIB,
        optimizer=trainable * 8 / MIB,
        reference=n * 4 / MIB if facts.reference_copy else 0.0,
        engine=serving_bytes(shape, width) / MIB
        if in_process and not facts.shares_storage
        else 0.0,
        kv_cache=kv / MIB,
        activations=activations / MIB,
        logits=logits / MIB,
    )


FIXES = {
    "activations": "lower train.micro_batch_size or set train.max_tokens_per_micro_batch "
    "(or model.gradient_checkpointing=true)",
    "logits": "set train.logits_chunk_tokens=0 (chunked) or lower train.micro_batch_size",
    "kv_cache": "lower rollout.batch_size",
    "reference": "set algo.kl.beta=0 (no reference copy) or use model.lora.rank > 0",
    "optimizer": "use model.lora.rank > 0 (adapters only)",
    "engine": "set model.dtype=bfloat16 (a half-size serving copy)",
}


def machine_mib() -> tuple[float, float]:
    """(total, available) memory of this machine in MiB (/proc/meminfo; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:  # kB
            values = {k: float(v.split()[0]) / 1024 for k, _, v in (x.partition(":") for x in f)}
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    return values.get("MemTotal", 0.0), values.get("MemAvailable", 0.0)


def check_memory(cfg: Config, *, total_mib: float | None = None) -> MemoryEstimate | None:
    """The estimate, after refusing (:class:`ConfigError`) a step that exceeds this machine's
    memory; prints one line when it exceeds what is free now. None on a GPU run (the device's
    memory is not modelled here) or where the model's config cannot be read."""
    if resolve(cfg).device == "cuda":
        return None
    try:
        shape = model_shape(cfg)
    except (OSError, ValueError, KeyError):
        return None  # the model checks report an unreadable checkpoint in their own words
    est = estimate(cfg, shape)
    note_idle_cores(cfg, shape)
    need = machine_need(cfg, est)
    total, free = machine_mib()
    total = total if total_mib is None else total_mib
    ranks = ranks_here(cfg)
    what = "the step needs" if ranks == 1 else f"the step's {ranks} trainer ranks need"
    if total and need > total:
        terms = {k: v for k, v in asdict(est).items() if k in FIXES}
        worst = max(terms, key=terms.get)
        each = f"~{est.trainer_rank:,.0f} MiB each; " if ranks > 1 else ""
        raise ConfigError(
            f"memory: {what} ~{need:,.0f} MiB ({each}largest: {worst} "
            f"{terms[worst]:,.0f} MiB) and this machine has {total:,.0f} MiB; "
            f"{FIXES[worst]}"
        )
    if free and need > free:
        print(
            f"rlpost: {what} ~{need:,.0f} MiB and {free:,.0f} MiB are free now; "
            "other processes may push it into swap",
            flush=True,
        )
    return est


def machine_need(cfg: Config, est: MemoryEstimate) -> float:
    """MiB this machine holds: one rank's estimate (with the engine) and each further
    trainer rank here."""
    return est.total + (ranks_here(cfg) - 1) * est.trainer_rank


REAL_SHAPE_PARAMS, REAL_SHAPE_VOCAB = 10_000_000, 32_000
"""From here on a step is matmul-bound, not overhead-bound: more threads pay."""


def note_idle_cores(cfg: Config, shape: dict) -> bool:
    """One line (True) when a fixed ``run.threads`` leaves cores idle at a real shape (the
    toy recipe's 1 is 1.6x slower than ``run.threads=0`` at a 151,936-token vocabulary)."""
    real = shape["params"] >= REAL_SHAPE_PARAMS or shape["vocab"] >= REAL_SHAPE_VOCAB
    threads, cores = cfg.run.threads, _usable_cores()
    if not 0 < threads < cores or not real:
        return False
    print(
        f"rlpost: run.threads={threads} leaves {cores - threads} of {cores} cores idle for a model of "
        f"{shape['params'] / 1e6:.0f}M parameters (vocabulary {shape['vocab']:,}); "
        "run.threads=0 uses the cores other work leaves free",
        flush=True,
    )
    return True


def summary_fields(est: MemoryEstimate | None) -> dict:
    """``summary.json`` fields: the measured peak RSS of this process and the estimate."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    estimated = {"memory_estimate_mib": est.as_dict()} if est is not None else {}
    return {"peak_rss_mib": round(peak, 1)} | estimated
