"""One typed config tree, the single source of truth for a run.

Sections mirror the packages. Each field's docstring is its help text
(``rlpost config --keys`` prints them). A recipe is a YAML file of this tree;
dotted ``key=value`` overrides on the command line are applied on top
(``rlpost train grpo_arith train.optim.lr=1e-5 rollout.n=8``). The recipes ship with the
package (``rlpost/recipes``); a recipe argument is a path or a shipped recipe's name.

Validation happens at load, before any work: unknown keys, bad values and
combinations that would silently break training are refused with one line
naming the key, the value, the reason and the fix.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rlpost.params import (
    AdvantageChoice,
    CorrectionChoice,
    GRPOParams,
    LossChoice,
    NoCorrection,
    ParamSet,
    PPOClipParams,
    UserPart,
    Variant,
    bare,
    choice,
    variants,
)

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A config problem, stated in one line (key, value, reason, fix)."""


class Section(BaseModel):
    model_config = ParamSet.model_config  # unknown keys refused, docstrings as help


# YAML reads ``on`` and ``off`` as booleans: a field whose choices are those words
# (``train.packing``) takes them back as the words.
OnOff = BeforeValidator(lambda v: ("on" if v else "off") if isinstance(v, bool) else v)


# --------------------------------------------------------------------------- run


class RunConfig(Section):
    output_dir: str = "runs"
    """Parent directory of run directories."""
    name: str = "grpo_arith"
    """Run name; the run directory is ``output_dir/name`` (one path part: not empty, ``.`` or
    ``..``, no slash)."""
    overwrite: bool = False
    """Replace an existing run directory of the same name (its files are deleted); without it
    an existing run directory is refused (``--overwrite`` on the command line sets it)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads; 0: the cores other processes leave free at start (cores minus
    the CPUs busy in a short /proc/stat sample, at least 1), said in one line and re-checked
    after every step as the load moves. Tiny models run best on 1 (docs/performance.md)."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Where the trainer and the in-process engine compute: cpu; cuda (the current GPU, or
    one per data-parallel rank, with bf16 autocast when model.dtype=bfloat16; refused
    where torch sees no GPU); auto (cuda when torch sees a GPU, else cpu)."""
    malloc_mmap_threshold: int = Field(0, ge=0, le=32 * 1024 * 1024)
    """Bytes: fix glibc's mmap threshold in the training process (allocations this large or
    larger are mapped and returned on free); 0 keeps glibc's dynamic threshold. 131072 cut
    peak RSS ~16% at ~25M parameters and cost 20-45% of the step time (docs/performance.md,
    Memory). Linux/glibc only; elsewhere it changes nothing."""

    @field_validator("name")
    @classmethod
    def _one_path_part(cls, name: str) -> str:
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise ValueError(
                f"run.name={name!r} must name one directory inside run.output_dir "
                "(not empty, '.' or '..', no slash)"
            )
        return name


# ------------------------------------------------------------------------- model


class TinyModelConfig(Section):
    """The built-in tiny Llama-family model, built from this config."""

    hidden_size: int = Field(64, ge=8)
    """Width of the residual stream."""
    intermediate_size: int = Field(256, ge=8)
    """Width of the MLP."""
    num_hidden_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads (hidden_size must divide by it)."""
    num_key_value_heads: int = Field(4, ge=1)
    """KV heads (grouped-query attention when smaller than the head count)."""
    max_position_embeddings: int = Field(128, ge=16)
    """Longest sequence the model handles."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick sizes that divide"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class LoRAConfig(Section):
    """Low-rank adapters through peft (extra [lora]): only the adapters train, the reference is
    the base model with the adapters disabled (no second copy), engines get merged weights."""

    rank: int = Field(0, ge=0)
    """Adapter rank (0: off, every weight trains)."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""
    target_modules: list[str] = [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    """Names of the linear layers that get adapters (those the model has are used)."""

    @model_validator(mode="after")
    def _peft_installed(self) -> LoRAConfig:
        if self.rank:
            try:
                import peft  # noqa: F401
            except ImportError:
                raise ValueError(
                    "model.lora.rank > 0 needs peft: pip install 'rlpost[lora]'"
                ) from None
        return self


class TeacherConfig(Section):
    path: str | None = None
    """Local directory (or .gguf file) of the teacher, a causal LM with the student's tokenizer
    (e.g. a trained run's checkpoints/step_N/model), run in this process. None: no local teacher."""
    url: str | None = None
    """Base URL of a server that returns prompt logprobs of given token ids (rlpost serve's
    /v1/prompt_logprobs), instead of path. Gives no full logits: not for algo.loss=gkd."""
    api_key: str | None = None
    """Bearer key sent to the teacher server (rlpost serve --api-key)."""
    timeout_s: float = Field(120.0, gt=0.0)
    """Seconds one scoring request to the teacher server may take."""
    micro_batch_size: int = Field(64, ge=1)
    """Rows per forward pass of the local teacher."""


class ModelConfig(Section):
    path: str | None = None
    """Local directory of a Hugging Face causal LM and its tokenizer, or a .gguf file (read
    dequantized; extra [gguf], docs/models.md). None: the built-in tiny model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the built-in tiny model (used when path is None)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Compute dtype of the policy (the rollout copy's weights and the trainer's autocast).
    Master weights and optimizer state stay float32. auto: bfloat16 on a CPU with native bf16
    instructions (AVX-512 BF16 or AMX, detected), else float32 (docs/performance.md)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lora: LoRAConfig = LoRAConfig()
    """Train low-rank adapters instead of every weight (model.lora.rank > 0)."""
    teacher: TeacherConfig = TeacherConfig()
    """The on-policy distillation teacher (algo.advantage=on_policy_distill or algo.loss=gkd)."""


# -------------------------------------------------------------------------- data
#
# A source of prompts is a task (a choice: a built-in task, a file, a reasoning-gym task, a
# verifiers environment's dataset) and how its rows become prompts. ``data.sources`` lists
# named sources; ``data.task`` alone is one unnamed source (the rows carry no source name).
# Each task's loader is registered under its name in rlpost.data.tasks.


class ArithConfig(Variant):
    """The built-in verifiable arithmetic task."""

    name: Literal["arith"] = "arith"
    max_operand: int = Field(20, ge=1)
    """Operands are drawn from 0..max_operand."""
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    """Operators to draw from."""
    train_size: int = Field(20000, ge=1)
    """Number of training problems."""
    eval_size: int = Field(500, ge=1)
    """Number of held-out problems (never seen in training or warm-up)."""


class CodeTaskConfig(Variant):
    """The built-in code task (write f(x) that passes asserts, checked in the sandbox)."""

    name: Literal["code"] = "code"
    train_size: int = Field(1000, ge=1)
    """Number of training problems (at most the space minus eval_size)."""
    eval_size: int = Field(50, ge=1)
    """Number of held-out problems."""


class FileTaskConfig(Variant):
    """Rows of user files: prompts with reference answers (rlpost train), or preference pairs
    (rlpost dpo, rlpost rm)."""

    name: Literal["file"] = "file"
    train_path: str | None = None
    """JSONL or Parquet file, or a ``datasets`` save_to_disk directory, of training rows."""
    eval_path: str | None = None
    """The same for held-out rows (None: eval_fraction of train_path's rows is held out)."""
    prompt_field: str = "prompt"
    """Column holding the prompt text."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    chosen_field: str = "chosen"
    """Column holding the preferred response (preference pairs)."""
    rejected_field: str = "rejected"
    """Column holding the dispreferred response (preference pairs)."""
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of train_path's rows held out, seeded, when eval_path is None."""
    stream: bool = False
    """Read train_path lazily (JSONL or Parquet), shuffled by a buffer, instead of loading it
    whole (a source of data.sources)."""
    shuffle_buffer: int = Field(10000, ge=1)
    """Rows held by a streamed source's shuffle buffer: more mixes better, costs memory."""


def prefs_task_problem(
    max_operand: int, ops: list[str], eval_size: int, rejected_per_prompt: int, max_offset: int
) -> str | None:
    """Why these built-in preference-task settings cannot work (one line), or None."""
    if len(set(ops)) != len(ops):
        # A repeated operator repeats prompts, which could then sit in both splits.
        return f"ops={ops} repeats an operator; list each once"
    space = len(ops) * (max_operand + 1) ** 2
    if eval_size >= space:
        return (
            f"eval_size={eval_size} leaves no training prompts (the space has {space}); "
            "raise max_operand or lower eval_size"
        )
    if not 1 <= rejected_per_prompt <= 2 * max_offset:
        return (
            f"rejected_per_prompt={rejected_per_prompt} must be in 1..{2 * max_offset} "
            f"(the wrong answers within max_offset={max_offset}); raise max_offset or lower it"
        )
    return None


class PrefsTaskConfig(Variant):
    """The built-in preference task (rlpost dpo): correct arithmetic result over a nearby wrong one."""

    name: Literal["prefs"] = "prefs"
    max_operand: int = Field(30, ge=1)
    """Operands are drawn from 0..max_operand."""
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    """Operators to draw from."""
    train_size: int = Field(100000, ge=1)
    """Training prompts (each gives rejected_per_prompt pairs)."""
    eval_size: int = Field(300, ge=1)
    """Held-out prompts, one pair each (never seen in warm-up or training)."""
    rejected_per_prompt: int = Field(2, ge=1)
    """Wrong answers paired with each training prompt."""
    max_offset: int = Field(20, ge=1)
    """Rejected answers are off by 1..max_offset in either direction."""

    @model_validator(mode="after")
    def _fits(self) -> PrefsTaskConfig:
        problem = prefs_task_problem(
            self.max_operand, self.ops, self.eval_size, self.rejected_per_prompt, self.max_offset
        )
        if problem is not None:
            raise ValueError(problem)
        return self


class ReasoningGymConfig(Variant):
    """A reasoning-gym task (extra [reasoning_gym]): rows generated at load."""

    name: Literal["reasoning_gym"] = "reasoning_gym"
    task: str = ""
    """The task's registered name in reasoning-gym (e.g. basic_arithmetic, leg_counting)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's generator settings (its config dataclass's fields, seed and size aside)."""
    train_size: int = Field(1000, ge=1)
    """Unique training rows asked for (fewer when the task's space holds fewer; reported)."""
    eval_size: int = Field(100, ge=0)
    """Unique held-out rows asked for, none of them a training row's question."""
    seed: int = 0
    """Generator seed: the rows do not depend on the run's seed."""
    evaluate_answers: bool = False
    """Allow a task whose scorer evaluates the answer as code (eval, sympy's parse_expr):
    scored in the sandbox, the evaluation apart from the score. Off: such a task is refused."""


class VerifiersSourceConfig(Variant):
    """A verifiers environment's dataset (extra [verifiers]): its rows, answers and info,
    loaded offline at start (docs/agents.md "verifiers environments")."""

    name: Literal["verifiers"] = "verifiers"
    env: str = ""
    """The environment: an installed environment's id (what vf.load_environment loads) or
    ``package.module:function`` returning one."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's load_environment (or of the function)."""
    train_size: int | None = Field(None, ge=1)
    """Rows of its dataset to train on, from the first (None: all)."""
    eval_size: int | None = Field(None, ge=0)
    """Rows of its eval dataset held out, from the first (None: all; 0: none)."""


PROMPT_TASKS = (
    ArithConfig,
    CodeTaskConfig,
    FileTaskConfig,
    ReasoningGymConfig,
    VerifiersSourceConfig,
)


class DataConfig(Section):
    task: choice("arith", *PROMPT_TASKS, PrefsTaskConfig) = ArithConfig()  # type: ignore[valid-type]
    """The one source's task when data.sources is empty: a built-in arithmetic or code task
    (rlpost train), the built-in preference task (rlpost dpo), user files (prompt rows, or pairs
    for dpo and rm), a reasoning-gym task or a verifiers environment's dataset."""
    on_bad_row: Literal["skip", "error"] = "error"
    """Malformed rows: skip them (counted and reported) or stop with file and line."""
    prompt_template: str = "{prompt}"
    """Format string applied to each prompt: ``{prompt}`` is the row's prompt, and a file's other
    fields can be named too (``"{question} (level {level})"``)."""
    chat_template: Literal["auto", "none"] = "auto"
    """auto: a tokenizer with a chat template gets each prompt as a user message, rendered with
    the generation prompt; none: plain text."""
    system_prompt: str | None = None
    """System message before each prompt (a first paragraph when no chat template applies)."""
    sources: list[SourceConfig] = []
    """Named sources of prompts, each with its task, weight, reward terms, template and system
    prompt (docs/data.md); set, they replace task and prompt_template. []: task is the one source."""

    @property
    def prompt_sources(self) -> list[SourceConfig]:
        """``sources``, or the one unnamed source ``task`` and ``prompt_template`` make."""
        if self.sources:
            return self.sources
        one = {"task": self.task, "prompt_template": self.prompt_template}
        return [SourceConfig.model_construct(name="", **one)]


# ----------------------------------------------------------------------- rollout


SAMPLING_PRESETS: dict[str, dict[str, float]] = {
    # Verifiable-reward RL wants the model's full distribution: no truncation.
    "rlvr": {"temperature": 1.0, "top_p": 1.0, "top_k": -1},
    # Preference RL trims the far tail a little to keep text fluent.
    "rlhf": {"temperature": 0.8, "top_p": 0.95, "top_k": -1},
}


AutoEngine, HFEngine, HFContinuousEngine = (bare(n) for n in ("auto", "hf", "hf_continuous"))


class VLLMEngine(Variant):
    name: Literal["vllm"] = "vllm"
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallel degree."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take."""
    max_model_len: int | None = None
    """vLLM context length (None: the model's)."""


class RemoteEngine(Variant):
    name: Literal["remote"] = "remote"
    servers: list[str] = Field(default_factory=list)
    """Base URLs of the rollout servers (rlpost serve, vllm serve, SGLang)."""
    server_model: str | None = None
    """Model name sent to the servers (None: the server's own)."""
    server_timeout_s: float = Field(120.0, gt=0)
    """Seconds before a server request is given up and re-sent elsewhere."""
    api_key_env: str | None = Field("RLPOST_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the servers' API key, sent as a Bearer token
    (unset or empty: none). A name, never the key: keys stay out of recipes and config.yaml."""
    admin_key_env: str | None = Field("RLPOST_ADMIN_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the servers' admin key, sent with weight pushes
    (server=vllm: it signs them, each vllm serve holding it as RLPOST_WEIGHTS_KEY)."""
    server: Literal["rlpost", "vllm", "openai"] = "rlpost"
    """What the servers are: rlpost (``rlpost serve``: weights over its sync routes), vllm (a
    stock ``vllm serve`` started as docs/rollout.md says: weights through its development
    routes) or openai (any OpenAI-compatible endpoint; it cannot take weights, so
    evaluation only)."""


EngineChoice = choice("auto", AutoEngine, HFEngine, HFContinuousEngine, VLLMEngine, RemoteEngine)


class RolloutConfig(Section):
    engine: EngineChoice = AutoEngine()  # type: ignore[valid-type]
    """Rollout engine and its parameters: auto (the in-process engine the run needs:
    hf_continuous with rollout.partial, pipeline.mode=async or agent.harness, else hf), hf
    (transformers in this process, batch decoding), hf_continuous (transformers in this
    process, continuous batching), vllm (extra [vllm];
    tensor_parallel_size, gpu_memory_utilization, max_model_len) or remote (rollout servers:
    servers, server_model, server_timeout_s, api_key_env, admin_key_env)."""
    preset: Literal["rlvr", "rlhf"] | None = None
    """Sampling preset filling temperature / top_p / top_k that are not set explicitly."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("preset") in SAMPLING_PRESETS:
            data = {**SAMPLING_PRESETS[data["preset"]], **data}
        return data

    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled each RL step."""
    n: int = Field(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0: greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens (-1: all)."""
    max_tokens: int = Field(16, ge=1)
    """Longest response; a response that reaches it is truncated."""
    truncated_reward: float | None = 0.0
    """Reward given to a truncated response (None: score it like any other)."""
    batch_size: int = Field(64, ge=1)
    """Sequences decoded together by the in-process engine."""
    share_prefix: bool = True
    """Prefill a group's prompt once and share its KV cache across the group."""
    partial: bool = False
    """Partial rollout: a step trains once partial_fraction of its samples are done; the rest carry on next step."""
    partial_fraction: float = Field(0.8, gt=0.0, le=1.0)
    """Fraction of a step's samples that must be done before it trains (with rollout.partial)."""
    partial_chunk_tokens: int | None = Field(None, ge=1)
    """Tokens per request when a partial step drives a remote or vLLM engine in chunks
    (None: max(8, max_tokens / 4)); the in-process engine stops exactly and ignores it."""
    length_aware: bool = False
    """Order each step's prompts by predicted response length so decode batches hold similar lengths."""


# -------------------------------------------------------------------------- algo


class KLConfig(Section):
    estimator: str = "k3"
    """KL estimator: k1, k2, k3 (low variance), abs, or straight-through k1+ / k3+ / abs+."""
    beta: float = Field(0.04, ge=0.0)
    """KL coefficient (0: no reference model is kept)."""
    placement: Literal["loss", "reward"] = "loss"
    """Add the KL to the loss (GRPO) or subtract it from the per-token reward (PPO, REINFORCE++)."""
    target: float | None = None
    """Target KL for the adaptive controller (None: fixed beta)."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon in samples."""


class AlgoConfig(Section):
    advantage: AdvantageChoice = GRPOParams()
    """Advantage estimator and its parameters, ``{name: grpo, eps: 1e-6}`` or just ``grpo``
    (docs/algorithms.md)."""
    loss: LossChoice = PPOClipParams()
    """Policy loss and its parameters, ``{name: dapo, clip_high: 0.3}`` or just ``dapo``."""
    loss_agg_mode: str = "token-mean"
    """How a [B, T] loss is reduced: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm."""
    kl: KLConfig = KLConfig()
    """KL penalty against the frozen reference policy."""
    rollout_correction: CorrectionChoice = NoCorrection()
    """Importance correction between the policy that sampled (the engine's logprobs) and the
    one the loss is computed against: none, tis (token truncated IS, cap), seq_tis (sequence
    truncated IS, cap), mask (IcePop: tokens whose ratio leaves [low, high] are masked),
    seq_mask (such rows are masked whole; cap, low, high). docs/algorithms.md, "Rollout
    corrections"."""
    old_logprobs: Literal["trainer", "rollout"] = "trainer"
    """The logprobs the policy loss's ratio is taken against. trainer: recomputed by the trainer
    before the update (the proximal policy; a forward pass over the batch when the batch makes
    more than one optimizer step). rollout: the engine's own sampling logprobs, no extra pass
    (the behaviour policy; exact when the engine serves the trainer's weights in the trainer's
    dtype, as in sync mode; samples from older weights are then clipped against the weights
    that sampled them)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient."""
    nll_coef: float = Field(0.0, ge=0.0)
    """Coefficient of an NLL (language-model) loss on the rewarded samples (score > 0), averaged
    over their tokens: VAPO's positive-example LM loss (0: off; VAPO uses 0.1)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more until the batch is full."""
    max_sampling_rounds: int = Field(3, ge=1)
    """Cap on rollout rounds per step under dynamic sampling."""


# ------------------------------------------------------------------------- train


class OptimConfig(Section):
    """AdamW and its schedule, the same keys in every section that trains (train, critic,
    sft, dpo, rm). The LR rises linearly over warmup_steps; after it, RL keeps it constant
    and an offline run (sft, dpo, rm) decays it on a cosine to a tenth at its last step."""

    lr: Annotated[float, Field(gt=0.0)] | Literal["auto"] = 1e-5
    """Peak learning rate. ``auto`` (train.optim only): scaled to the policy's size,
    1e-6 x (7e9 / parameters) ** 0.76, two significant digits (SmolLM2-135M 2e-5, 0.5B
    7.5e-6, 7B 1e-6), ten times that with LoRA adapters."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warm-up, in optimizer updates."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip of each update."""


class Trains(Section):
    """A section with an optimizer: a partial ``optim`` keeps the section's defaults for the
    keys it leaves out."""

    section: ClassVar[str] = ""
    optim: OptimConfig = OptimConfig()

    @model_validator(mode="after")
    def _auto_lr_is_the_policys(self) -> Trains:
        if self.optim.lr == "auto" and self.section != "train":
            raise ValueError(
                f"{self.section}.optim.lr=auto: only the RL policy's rate is scaled to the model"
                f" (train.optim.lr); give {self.section}.optim.lr a number"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _optim_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("optim"), dict):
            defaults = cls.model_fields["optim"].default.model_dump()
            data = {**data, "optim": {**defaults, **data["optim"]}}
        return data


class TrainConfig(Trains):
    section: ClassVar[str] = "train"
    steps: int = Field(60, ge=0)
    """RL steps (one rollout batch each)."""
    optim: OptimConfig = OptimConfig(lr=1e-5, warmup_steps=5)
    """The policy's optimizer."""
    mini_batch_size: int = Field(64, ge=1)
    """Sequences per optimizer update."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward pass (gradient accumulation inside a mini-batch)."""
    epochs: int = Field(1, ge=1)
    """Passes over each rollout batch (PPO epochs)."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget of a micro-batch (and of the scoring passes' batches): rows, longest
    first, go into micro-batches of at most micro_batch_size rows whose padded size (rows x
    widest row) stays within it, each trimmed to its own widths, so one long row does not
    set the shape of the others. 0: micro-batches of micro_batch_size rows, the batch's
    widths. Not with data parallel (cluster.trainer_workers > 1)."""
    logits_chunk_tokens: int = Field(0, ge=-1)
    """Response tokens per chunk of the LM head in the trainer's passes (logprobs, entropy):
    the full [B, T, V] logits never exist. 0: what fits 64 MiB of float32 logits; -1: the
    whole logits at once (the unchunked path)."""
    packing: Annotated[Literal["auto", "shared", "on", "off"], OnOff] = "auto"
    """Padding-free passes: the rows of a micro-batch (and of a scoring pass) run end to end
    in sequences as wide as the model's attention makes cheap (at most 2,048 tokens),
    position ids restarting at each row, attention kept within rows; the token budget then
    counts real tokens. on: pack; shared (and auto): pack, and the rows with the same prompt
    (a GRPO group) run it once, each response seeing the prompt and itself (a group of G
    rows costs p + G r tokens, not G (p + r); mini-batches then shuffle whole groups); off:
    pad. A model whose attention would cross rows, or data-parallel trainers (not tensor-
    or pipeline-parallel ones), pad instead, and an attention that takes no custom mask
    (flash, flex) packs rows alone; each says so in one line."""


class CriticConfig(Trains):
    """The value model of PPO (used when algo.advantage.name is gae or vapo_gae)."""

    section: ClassVar[str] = "critic"
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=5)
    """The critic's optimizer (its LR usually higher than the policy's)."""
    head_start_steps: int = Field(0, ge=0)
    """RL steps in which only the critic trains, so its values are useful before the policy moves."""
    clip_range: float | None = Field(0.2, gt=0.0)
    """Value clipping around the old values (None: no clipping)."""
    epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""


class SFTConfig(Trains):
    """Supervised warm-up that produces the starting policy."""

    section: ClassVar[str] = "sft"
    steps: int = Field(300, ge=0)
    """Optimizer steps of warm-up (0: none)."""
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=20)
    """The warm-up's optimizer."""
    batch_size: int = Field(64, ge=1)
    """Sequences per step."""
    distractor: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of warm-up targets written with their digits reversed (27 -> 72): the starting
    policy can answer but does not reliably choose the right form, which RL then selects."""
    save_every: int = Field(100, ge=0)
    """Save a checkpoint of the warm-up (RUN_DIR/sft_state) every this many steps (0: only
    when stopped), so a killed warm-up continues from there."""
    data: Literal["task", "file", "chat_arith"] = "task"
    """What the warm-up trains on: task (the data section's prompt -> reference-answer rows),
    file (conversations: rows of OpenAI-style messages in sft.train_path, rlpost sft) or
    chat_arith (a built-in tiny multi-turn conversation set)."""
    train_path: str | None = None
    """JSONL or Parquet file of conversations (sft.data=file)."""
    eval_path: str | None = None
    """JSONL or Parquet file of held-out conversations (None: sft.eval_fraction of train_path)."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of the conversations held out when sft.eval_path is None (0: none)."""
    messages_field: str = "messages"
    """Column holding a row's list of messages (role: system, user, assistant or tool)."""
    answer_field: str = "answer"
    """Column holding a row's reference answer to its last turn, if any (held-out accuracy)."""
    last_turn_only: bool = False
    """Train on the last assistant turn of each conversation only (else on every one)."""
    max_seq_len: int | None = Field(None, ge=8)
    """Longest conversation in tokens; a longer one is a bad row (None: the model's context)."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget of a warm-up micro-batch (rows x widest row); 0: the whole step at once."""
    eval_every: int = Field(0, ge=0)
    """Held-out loss every this many steps (0: at the start and the end only)."""
    eval_max_tokens: int = Field(16, ge=1)
    """Longest greedy reply when the held-out accuracy is measured."""


# ------------------------------------------------------------------------ reward


class RewardTerm(UserPart):
    """``{name, weight, kind, ...the reward function's keyword parameters (params())}``."""

    name: str
    """Registered reward name, ``path/to/file.py:function`` or ``package.module:function``."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of this term in the weighted sum."""
    kind: Literal["verifiable", "rule", "model", "judge"] = "verifiable"
    """Rank of the signal: verifiable > rule > model > judge. Used by the mixture."""


class RewardConfig(Section):
    terms: list[RewardTerm] = [RewardTerm(name="numeric_match")]
    """Reward terms summed with their weights (per kind; see alpha)."""
    alpha: float | None = Field(None, ge=0.0, le=1.0)
    """Mixture: final = alpha * verifiable + (1 - alpha) * model/judge (None: plain weighted sum)."""
    invalid_score: float = Field(0.0, allow_inf_nan=False)
    """Score used in place of a NaN / Inf / out-of-range reward (the sample is counted)."""
    score_range: tuple[float, float] = (-10.0, 10.0)
    """Scores outside this range are treated as invalid."""

    @model_validator(mode="after")
    def _range_is_a_range(self) -> RewardConfig:
        lo, hi = self.score_range
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(
                f"reward.score_range={list(self.score_range)} must be [low, high] with finite "
                "low < high"
            )
        return self

    sample_every: int = Field(10, ge=0)
    """Write RUN_DIR/samples/step_N.jsonl every N steps (0: never)."""
    sample_count: int = Field(8, ge=1)
    """Completions written per sample file."""


# -------------------------------------------------------------- eval / ckpt / obs


class EvalConfig(Section):
    every: int = Field(10, ge=0)
    """Evaluate on the held-out split every N steps (0: only at start and end)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature for held-out accuracy (0: greedy). Greedy accuracy is also reported
    at the start and end of every run."""
    limit: int | None = None
    """Evaluate on the first N held-out problems only (None: all)."""
    samples: int = Field(1, ge=1)
    """Samples per held-out problem at the eval temperature; accuracy is their mean (pass@1),
    its standard error falls as 1/sqrt(samples * problems). Greedy always takes one."""
    sets: list[EvalSetConfig] = []
    """Evaluation sets, each a source with its own metrics (docs/data.md); set, they replace
    the held-out rows of data. []: one held-out evaluation of data's held-out rows."""


class CheckpointConfig(Section):
    every: int = Field(20, ge=0)
    """Save a checkpoint every N steps (0: only at the end)."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk (older ones are deleted)."""


class PrometheusConfig(Section):
    port: int | None = None
    """Serve /metrics on this port (None: off)."""
    host: str = "127.0.0.1"
    """Address to bind."""


class GuardConfig(Section):
    """Thresholds and remedies of the training guards (config section ``observe.guards``)."""

    enabled: bool = True
    """Act on problems (False: never act; NaN losses and rewards are then not caught)."""
    kl_ceiling: float = Field(5.0, gt=0)
    """Mean per-token KL to the reference [nats/token] above which the KL coefficient is raised."""
    kl_beta_factor: float = Field(2.0, gt=1)
    """Multiply the KL coefficient by this when KL exceeds kl_ceiling."""
    clip_frac_ceiling: float = Field(0.5, gt=0, le=1)
    """Ratio-clip fraction [0-1] above which the learning rate is lowered."""
    lr_factor: float = Field(0.5, gt=0, lt=1)
    """Multiply the learning rate by this on a clip-fraction breach or after a rollback."""
    reward_collapse_drop: float = Field(0.5, gt=0, le=1)
    """Relative fall of the reward EMA below its best that counts as collapse (0.5: lost half)."""
    reward_collapse_min_drop: float = Field(0.05, ge=0)
    """Absolute fall [reward units] also needed, so noise around zero reward is not a collapse."""
    reward_collapse_window: int = Field(5, ge=1)
    """EMA span in steps (alpha = 2/(window+1)); the rule arms after this many steps."""
    throughput_decay: float = Field(0.3, gt=0, lt=1)
    """Rebuild the engine when rollout tokens/s fall below this fraction of the best."""
    throughput_window: int = Field(10, ge=1)
    """Steps in the rolling median of rollout tokens/s."""
    cooldown: int = Field(3, ge=0)
    """Steps the KL and clip-fraction guards wait after acting, so a remedy can take effect."""
    max_retries: int = Field(3, ge=0)
    """Uses of each remedy (per soft guard; rollbacks; rebuilds) before escalating or stopping."""


class ObserveConfig(Section):
    prometheus: PrometheusConfig = PrometheusConfig()
    """Prometheus endpoint."""
    tensorboard: bool = False
    """Write TensorBoard event files to RUN_DIR/tb (needs the [tensorboard] extra)."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = []
    """Metric loggers besides RUN_DIR/metrics.jsonl (always written), each an extra of its own
    name: tensorboard (RUN_DIR/tb), wandb (offline into RUN_DIR unless WANDB_MODE says
    otherwise), mlflow (a file store in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set)."""
    progress: bool = True
    """Show progress on stderr: a line and a live bar for each long phase (model loading,
    held-out evaluation, warm-up, RL steps). The end-of-run table shows either way."""
    plot: bool = True
    """Write RUN_DIR/curves.png at the end."""
    guards: GuardConfig = GuardConfig()
    """Guards that act when training starts to collapse."""

    @model_validator(mode="after")
    def _extras_installed(self) -> ObserveConfig:
        import importlib.util

        wanted = [*self.loggers, *(["tensorboard"] if self.tensorboard else [])]
        for name in wanted:
            if importlib.util.find_spec(name) is None:
                key = "observe.tensorboard=true" if name == "tensorboard" else "observe.loggers"
                raise ValueError(
                    f"{key} asks for {name}, which is not installed; "
                    f"pip install 'rlpost[{name}]' or leave it out"
                )
        return self


# --------------------------------------------------------------------------- dpo


class PairsTrains(Trains):
    """A section that trains on preference pairs (rlpost dpo, rlpost rm)."""

    batch_size: int = Field(64, ge=1)
    """Pairs per optimizer step."""
    micro_batch_size: int = Field(64, ge=1)
    """Pairs per forward/backward pass (gradient accumulation inside a step)."""

    @model_validator(mode="after")
    def _micro_fits(self) -> PairsTrains:
        if self.micro_batch_size > self.batch_size:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} is larger than "
                f"batch_size={self.batch_size}; set micro_batch_size <= batch_size"
            )
        return self


class DPOConfig(PairsTrains):
    """Offline preference optimisation (``rlpost dpo``): DPO or IPO against the frozen warm-up policy."""

    section: ClassVar[str] = "dpo"

    beta: float = Field(0.1, gt=0.0)
    """Strength of the implicit KL to the reference (DPO beta; IPO's margin is 1/(2 beta))."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (arXiv 2305.18290); ipo: IPO's squared loss (arXiv 2310.12036)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """Assumed rate of flipped labels (conservative DPO); sigmoid loss only."""
    optim: OptimConfig = OptimConfig(lr=5e-4, warmup_steps=10)
    """The optimizer of the DPO steps."""
    steps: int = Field(400, ge=0)
    """Optimizer steps."""
    save_every: int = Field(100, ge=0)
    """Save a checkpoint (RUN_DIR/dpo_state) every N steps (0: only when stopped)."""
    eval_every: int = Field(50, ge=0)
    """Evaluate on the held-out pairs every N steps (0: only at start and end)."""

    @model_validator(mode="after")
    def _consistent(self) -> DPOConfig:
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ValueError(
                f"label_smoothing={self.label_smoothing} has no effect with loss_type=ipo; "
                "set it to 0 or use loss_type=sigmoid"
            )
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`rlpost.algos.dpo.dpo_loss` this section sets."""
        return self.model_dump(include={"beta", "loss_type", "label_smoothing"})


# ------------------------------------------------------------------- reward model


class RMConfig(PairsTrains):
    """Reward-model training (``rlpost rm``): a one-output sequence classifier on preference
    pairs with the Bradley-Terry loss, started from model.path (or the tiny model)."""

    section: ClassVar[str] = "rm"
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=10)
    """The reward model's optimizer."""
    steps: int = Field(300, ge=1)
    """Optimizer steps."""
    eval_every: int = Field(50, ge=0)
    """Held-out pairwise accuracy and loss every N steps (0: at the start and the end only)."""
    save_every: int = Field(100, ge=0)
    """Save a checkpoint (RUN_DIR/rm_state) every N steps (0: only when stopped)."""
    margin_field: str | None = None
    """Column of a pairs file (data.task=file) holding each pair's margin m in
    -log sigmoid(r_chosen - r_rejected - m); None: no margin."""


# ---------------------------------------------------------------------- pipeline


class PipelineConfig(Section):
    """How rollout and training are scheduled against each other."""

    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """sync: generate, then train, every step on the newest weights; one_step_off: the rollout
    of step k+1 runs while step k trains (samples one version old); async: rollout runs
    continuously and the trainer takes a batch as soon as one is ready, within max_staleness."""
    max_staleness: int = Field(1, ge=0)
    """async: the most versions a trained sample's oldest token may lag the weights being
    trained (eta). New rollouts are admitted only while this holds, so nothing is wasted."""
    stale: Literal["wait", "drop"] = "wait"
    """A group that still exceeds max_staleness when it reaches the trainer (a long sample that
    spanned many updates): wait trains it anyway, corrected by the importance weight; drop
    discards it (counted in sample_drop_ratio) and its prompt is sampled again."""
    queue_batches: int = Field(2, ge=1)
    """async: rollout batches that may wait, finished, for the trainer."""


# ----------------------------------------------------------------------- cluster


class RoleResources(Section):
    """What one worker of a role asks the Ray cluster for (one placement-group bundle)."""

    cpus: float = Field(1.0, ge=0)
    """CPUs per worker (Ray logical CPUs; also the worker's torch threads, at least 1)."""
    gpus: float = Field(0.0, ge=0)
    """GPUs per worker; a fraction (0.5) lets workers share one GPU (colocated placement)."""
    resources: dict[str, Annotated[float, Field(gt=0)]] = {}
    """Custom Ray resources per worker, e.g. ``{rollout_node: 1}``: the worker goes only to
    nodes started with them (``ray start --resources '{"rollout_node": 8}'``)."""

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, v: dict[str, float]) -> dict[str, float]:
        taken = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(v))
        if taken:
            raise ValueError(f"{', '.join(taken)}: Ray's own, not custom; set cpus / gpus instead")
        return v


class HalfCpuResources(RoleResources):
    """What one rollout or reward worker asks for (half a CPU unless set)."""

    cpus: float = Field(0.5, ge=0)
    """CPUs per worker (Ray logical CPUs; also the worker's torch threads, at least 1)."""


class ClusterConfig(Section):
    """Where the workers live. The loop talks to them only through their protocols, so the
    same run goes in one process, across processes or across a Ray cluster unchanged."""

    backend: Literal["auto", "local", "process", "ray"] = "auto"
    """local: every worker in this process; process: the trainer and the rollout worker each in
    its own OS process (multiprocessing, spawn), the reward worker in this one; ray: every worker
    a Ray actor (extra [ray]; docs/cluster.md); auto: local for pipeline.mode=sync, process for
    the overlapped modes (so rollout and training use different cores)."""
    trainer_workers: int = Field(1, ge=1)
    """Trainer workers, data-parallel x pipeline stages x tensor-parallel; each update's
    batch is sharded over the data-parallel ones (FSDP2)."""
    tensor_parallel: int = Field(1, ge=1)
    """Trainer workers that split each decoder layer's heads and MLP width, and the embedding
    and LM head by vocabulary, between them (tensor parallelism, neighbours in rank order);
    divides trainer_workers, heads, KV heads, intermediate size and vocabulary.
    docs/cluster.md: choosing a layout."""
    pipeline_parallel: int = Field(1, ge=1)
    """Trainer workers that split the decoder layers into consecutive stages, one each
    (pipeline parallelism: each holds its stage's weights, gradients and optimizer state;
    the stages compute in turn); at most the model's layers. trainer_workers is data-parallel
    x it x tensor_parallel (each stage's layers split over its tensor-parallel ranks, then
    FSDP2-sharded over its replicas)."""
    start_timeout_s: float = Field(600.0, gt=0)
    """Seconds a worker process may take to start (build its model) before the run stops."""
    address: str = ""
    """Ray cluster to join: empty starts a local one on this machine (stopped at the end);
    ``auto`` joins the one ``ray start`` began on this machine; ``host:port`` joins that one."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout workers (process or ray backend): each step's prompts are split over them; a lost
    one's prompts go to the others and it is restarted and synced before it serves again."""
    reward_workers: int = Field(0, ge=0)
    """Reward workers on Ray (each hosts the reward terms: sandbox pool, reward models); 0 scores
    in the driver. Each scoring call's groups are split over them."""
    placement: Literal["split", "colocated"] = "split"
    """split: a placement group per role, rollout and training on different resources;
    colocated: rollout workers are placed in the trainers' bundles and share their resources
    (fractional GPUs; on CPU the same cores take turns)."""
    trainer: RoleResources = RoleResources()
    """Resources of each trainer worker."""
    rollout: HalfCpuResources = HalfCpuResources()
    """Resources of each rollout worker."""
    reward: HalfCpuResources = HalfCpuResources()
    """Resources of each reward worker."""
    max_restarts: int = Field(3, ge=0)
    """Restarts a lost rollout worker gets before it is retired (the run goes on with the rest)."""
    suspect_after_s: float = Field(120.0, gt=0)
    """A rollout call without a reply for this long makes its worker suspect."""
    dead_after_s: float = Field(1800.0, gt=0)
    """A rollout call without a reply for this long: the worker is stopped, its prompts re-sent."""
    drain_timeout_s: float = Field(30.0, gt=0)
    """After SIGTERM (a preemption notice) a rollout worker refuses new calls and exits once its
    running ones finish, or after this many seconds; what it did not finish is re-sent."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """Seconds a Ray placement group may take to be placed before the run stops (one line
    naming the role and the resource)."""
    share_cores: bool = True
    """process backend, one trainer and one rollout worker, run.threads >= 1: while the rollout
    process has no call running (it waits for weights), the trainer also runs on its cores,
    and hands them back when it starts again (docs/performance.md). Thread counts then change
    within a step, so the trainer's float rounding depends on timing; false keeps them fixed."""


# -------------------------------------------------------------------------- sync


class BF16Codec(Variant):
    name: Literal["bf16"] = "bf16"
    delta: bool = False
    """Send only the elements whose bf16 bit pattern changed since the last acknowledged
    version (exact; not on the disk channel)."""
    delta_full_threshold: float = Field(0.3, gt=0.0, le=1.0)
    """With delta, a tensor whose changed fraction is above this goes whole (a delta entry
    costs 6 bytes before compression, a whole bf16 element 2)."""


class FP8Codec(Variant):
    name: Literal["fp8"] = "fp8"
    keep_bf16: list[str] = Field(default_factory=lambda: ["embed", "lm_head", "norm"])
    """Regular expressions of tensor names sent as bf16 instead."""


class MXFP4Codec(FP8Codec):
    name: Literal["mxfp4"] = "mxfp4"  # type: ignore[assignment]


ChannelChoice = choice("inprocess", *map(bare, ("inprocess", "http", "disk", "gloo", "vllm")))
CodecChoice = choice("none", bare("none"), BF16Codec, FP8Codec, MXFP4Codec)


class SyncConfig(Section):
    channel: ChannelChoice = variants(ChannelChoice)["inprocess"]()  # type: ignore[valid-type]
    """How weights reach the engines: inprocess (same process), http (rlpost serve; what
    rollout.engine=remote uses), disk (a versioned directory, any number of readers), gloo
    (torch.distributed to engines in other processes; NCCL on GPU) or vllm (extra [vllm])."""
    codec: CodecChoice = variants(CodecChoice)["none"]()  # type: ignore[valid-type]
    """Wire encoding: none (the trainer's dtype), bf16 (delta, delta_full_threshold), fp8
    (e4m3, 128x128 blocks, lossy) or mxfp4 (e2m1, 32-element blocks, lossy); the lossy codecs
    send keep_bf16 tensors in bf16."""
    bucket_mb: float = Field(64.0, gt=0)
    """Bucket size [MiB]: tensors stream in buckets this large (larger tensors are split);
    a receiving server holds about one bucket in memory while a sync streams in."""
    every: int = Field(1, ge=1)
    """Sync every N steps; in between the engines serve an older version and samples carry it."""
    verify: bool = True
    """After each sync the engine reports a checksum of every tensor it now serves and the
    sender compares them with what it sent; a mismatch names the tensor."""
    timeout_s: float = Field(300.0, gt=0)
    """Seconds each sync phase (start, one bucket, finish) may take before it is an error."""

    @property
    def delta(self) -> bool:
        """Whether a sync sends only the changed elements (``codec: {name: bf16, delta: true}``)."""
        return getattr(self.codec, "delta", False)


# ------------------------------------------------------------------------- agent


class HarnessKnobs(Variant):
    chat_template: str | None = None
    """Jinja chat template the server renders the agent's chats with (None: the tokenizer's;
    rollout.engine=remote: the servers' own, so it must be None)."""
    tool_parser: str = "hermes"
    """How the model's output is read into tool_calls (rlpost serve --tool-parser)."""
    demonstrations: str | None = None
    """``package.module:function`` giving the warm-up a conversation per prompt:
    ``fn(prompt, answer, rng) -> {"messages": [...], "tools": [...]}`` or None (OpenAI
    messages; the assistant turns train, the rest is masked)."""
    max_requests: int = Field(8, ge=1)
    """Requests (model calls) per session; the next one is a 400 and the session ends as
    truncated. rollout.max_tokens bounds its sampled tokens, all requests together."""
    max_seconds: float = Field(120.0, gt=0)
    """Wall time of a session; requests after it are refused, and a harness still running 5 s
    later is counted as hung (harness_timed_out) and its session dropped."""
    workers: int = Field(8, ge=1)
    """Sessions run at once."""


class CommandHarness(HarnessKnobs):
    """The agent as a command: OPENAI_BASE_URL and OPENAI_API_KEY (its session's own key) in
    its environment, the prompt on stdin, a /tmp and /dev/shm of its own; its last stdout line
    is the answer, or ``reward: <number>`` for the session's reward (a number alone is an
    answer). Nothing it starts outlives it."""

    name: Literal["command"] = "command"
    command: list[str] = Field(default_factory=list)
    """The command line (argv)."""
    env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=list
    )
    """Names of the trainer's environment variables a command also gets. It gets no others
    but PATH, HOME, USER, LOGNAME, SHELL, TERM, TMPDIR, LANG, LANGUAGE, LC_* and TZ."""
    user: Literal["session", "trainer"] = "session"
    """Whose user a command runs as. session: when the trainer runs as root, a uid of its own
    per command (50000-59999, HOME a private directory), so no harness can read another's
    key from /proc; the command and what it reads must be readable by other users. trainer:
    the trainer's user (any process of that user can read the harnesses' keys)."""

    @model_validator(mode="after")
    def _runs_something(self) -> CommandHarness:
        if not self.command:
            raise ValueError(
                "agent.harness.command: set it, or agent.harness.name=path/to/file.py:function"
            )
        return self


class FunctionHarness(HarnessKnobs, UserPart):
    """The agent as the user's function ``name``, called ``fn(prompt, base_url, **info,
    **params)`` in a thread (info: api_key, session_id, metadata, those it accepts; params:
    its other keys); it returns its final answer (judged by the reward terms), a number (the
    session's reward) or None."""


class CalcEnv(Variant):
    name: Literal["calc"] = "calc"
    call_reward: float = 0.0
    """Reward of each call (a shaping term beside the outcome; 0: the outcome alone)."""


class CountdownEnv(Variant):
    name: Literal["countdown"] = "countdown"
    step_reward: float = 0.1
    """Reward of each valid step."""
    error_penalty: float = 0.1
    """Penalty of each step that fails (a number not left, a non-integer result)."""


class PythonEnv(Variant):
    name: Literal["python"] = "python"
    sandbox: dict[str, Any] | None = None
    """The sandbox's limits (SandboxConfig's keys; None: the defaults)."""
    pass_reward: float = 0.0
    """Reward of each call, times the fraction of the prompt's tests it passed."""


class VerifiersEnv(Variant):
    name: Literal["verifiers"] = "verifiers"
    env: str = ""
    """The verifiers environment: an installed id or ``package.module:function``."""
    env_args: dict[str, Any] | None = None
    """Keyword arguments of its load_environment."""


EnvChoice = choice(
    "none", bare("none"), CalcEnv, CountdownEnv, PythonEnv, VerifiersEnv, user=UserPart
)
HarnessChoice = choice("command", bare("none"), CommandHarness, user=FunctionHarness)
KNOBS = HarnessKnobs.model_fields.keys() - {"name"}


class AgentConfig(Section):
    """Multi-turn episodes: the policy calls tools of an environment between its turns."""

    env: EnvChoice = variants(EnvChoice)["none"]()  # type: ignore[valid-type]
    """Environment of every episode, ``{name, ...its constructor's keywords}``: a built-in,
    ``path/to/file.py:Class`` or ``package.module:Class``; none: single turns, no tools."""
    format: Literal["auto", "tags", "chat_template"] = "auto"
    """How calls are written: plain tags (call_template / result_template) or the tokenizer chat
    template's tool format (``<tool_call>{json}</tool_call>`` and its tool message); auto: the
    chat template's when prompts are rendered with it (data.chat_template=auto) and it renders
    tool messages, else plain tags."""
    call_template: str = "<{name}>{arguments}</{name}>"
    """Plain-tag call: {name} is a tool of the environment, {arguments} its input."""
    result_template: str = "<result>{output}</result>"
    """Plain-tag rendering of the environment's answer, appended as masked tokens."""
    max_turns: int = Field(4, ge=1)
    """Policy turns per episode; a call in the last one is not run (counted as a turn-budget end).
    rollout.max_tokens bounds the episode's tokens, policy and environment together."""
    max_tool_tokens: int = Field(64, ge=1)
    """Longest environment answer, in tokens (longer ones are cut)."""
    max_output_chars: int = Field(2000, ge=1)
    """Longest environment answer, in characters, before it is tokenized."""
    workers: int = Field(8, ge=1)
    """Environment steps run in parallel (threads: tools wait on sandboxes and networks)."""
    sft_direct: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of warm-up demonstrations that answer without calling a tool (the starting
    policy then sometimes answers in its head, which RL has to unlearn)."""
    harness: HarnessChoice = variants(HarnessChoice)["none"]()  # type: ignore[valid-type]
    """An outside agent written against the OpenAI API as the rollout, instead of env
    (docs/agents.md, "Bring your own harness"): none, command (a command line) or the user's
    function (``name: path/to/file.py:function``); a harness given without a name is a
    command."""


# ------------------------------------------------------------------ data sources


class SourceConfig(Section):
    """One source of prompts in ``data.sources``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Unique name: rows carry it, rewards are routed by it, metrics are labelled with it."""
    weight: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    """Share of each batch's prompts drawn from this source (weights need not sum to 1)."""
    task: choice("file", *PROMPT_TASKS) = FileTaskConfig()  # type: ignore[valid-type]
    """Where its rows come from and that task's own settings."""
    prompt_template: str = "{prompt}"
    """Format string over the row's fields, as data.prompt_template."""
    system_prompt: str | None = None
    """System message of this source's prompts (None: data.system_prompt)."""
    reward: list[RewardTerm] | None = None
    """This source's reward terms (None: reward.terms); alpha, invalid_score and score_range are
    the reward section's."""


class EvalSetConfig(SourceConfig):
    """One evaluation set of ``eval.sets``: a source's held-out rows (a file set reads
    eval_path) and the metrics computed on them."""

    metrics: list[str] = ["mean@1"]
    """Metrics of this set: mean@k, pass@k, maj@k (k samples per problem) and greedy."""
    samples: int | None = Field(None, ge=1)
    """Samples drawn per problem at eval.temperature (None: the largest k of its metrics)."""

    @property
    def n(self) -> int:
        """Samples per problem: ``samples``, or the largest k of the sampled metrics."""
        if self.samples is not None:
            return self.samples
        ks = [m.split("@", 1)[1] for m in self.metrics if "@" in m]
        return max((int(k) for k in ks if k.isdigit()), default=1)


DataConfig.model_rebuild()
EvalConfig.model_rebuild()


# -------------------------------------------------------------------------- root


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    critic: CriticConfig = CriticConfig()
    dpo: DPOConfig | None = None
    """rlpost dpo's section (None: its defaults; config --keys lists it once set)."""
    rm: RMConfig | None = None
    """rlpost rm's section (None: its defaults; config --keys lists it once set)."""
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    observe: ObserveConfig = ObserveConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cluster: ClusterConfig = ClusterConfig()
    sync: SyncConfig = SyncConfig()
    agent: AgentConfig = AgentConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        refuse_moved(data)
        return data

    @property
    def batch_size(self) -> int:
        """Sequences per RL step."""
        return self.rollout.prompts_per_step * self.rollout.n

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


# ---------------------------------------------------------------- moved keys

_ENTRY = r"(data|(?:data\.sources|eval\.sets)\[[^]]*\])"  # what holds a task
_TERM = r"((?:reward\.terms|(?:data\.sources|eval\.sets)\[[^]]*\]\.reward)\[[^]]*\])"
_TASKS = "|".join(t.model_fields["name"].default for t in (*PROMPT_TASKS, PrefsTaskConfig))
_FILE_KEYS = "|".join(FileTaskConfig.model_fields.keys() - {"name"})
MOVED: dict[str, str] = {
    rf"{_ENTRY}\.({_TASKS})\.(\w+)": r"\1.task.\3 (with \1.task.name=\2)",
    rf"{_ENTRY}\.({_FILE_KEYS})": r"\1.task.\2 (with \1.task.name=file)",
    **{
        rf"rollout\.{key}": f"rollout.engine.{key} (with rollout.engine.name={name})"
        for name, e in (("remote", RemoteEngine), ("vllm", VLLMEngine))
        for key in e.model_fields.keys() - {"name"}
    },
    r"algo\.policy_loss": "algo.loss",
    r"algo\.(loss|advantage)_params\.(\w+)": r"algo.\1.\2 (with algo.\1.name)",
    r"algo\.losses\.(\w+)\.(\w+)": r"algo.loss.\2 (with algo.loss.name=\1)",
    r"algo\.advantages\.(\w+)\.(\w+)": r"algo.advantage.\2 (with algo.advantage.name=\1)",
    r"critic\.warmup_steps": "critic.optim.warmup_steps (LR warm-up) or critic.head_start_steps"
    " (RL steps the critic trains alone)",
    rf"(train|critic|sft|dpo|rm)\.({'|'.join(OptimConfig.model_fields)})": r"\1.optim.\2",
    r"sync\.(delta|delta_full_threshold)": r"sync.codec.\1 (with sync.codec.name=bf16)",
    r"sync\.keep_bf16": "sync.codec.keep_bf16 (with sync.codec.name=fp8 or mxfp4)",
    r"agent\.harness\.entry": "agent.harness.name",
    r"agent\.params(\.\w+)?": r"agent.env\1 (with agent.env.name)",
    rf"{_TERM}\.params\.(\w+)": r"\1.\2",
}
"""Keys that moved: the old dotted key (a regular expression; a list entry is ``[its
name]``) -> the new key, the old one's groups filled in, then anything else to write."""


def refuse_moved(data: Any, at: str = "") -> None:
    """A ValueError for the first key of ``data`` (a config tree) that :data:`MOVED` holds:
    ``old=value: the key moved; write new=value``, the value shown at its leaf."""
    for key, value in data.items() if isinstance(data, dict) else ():
        path = f"{at}{key}"
        refuse_moved(value, path + ".")
        for i, entry in enumerate(value if isinstance(value, list) else ()):
            name = entry.get("name") if isinstance(entry, dict) else None
            refuse_moved(entry, f"{path}[{name or i}].")
        for old, new in MOVED.items():
            if found := re.fullmatch(old, path):
                new, _, more = found.expand(new).partition(" ")
                shown = yaml.safe_dump(value, default_flow_style=True, width=1e9)
                shown = shown.removesuffix("...\n").strip()  # true, [a, b]: as written
                raise ValueError(
                    f"{path}={shown}: the key moved; write {new}={shown} {more}".strip()
                )


# ------------------------------------------------------------------- loading


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML scalars/lists, except that
    a text field takes the text as written (``data.prompt_template=Q: {question}``)."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value; write e.g. train.optim.lr=1e-5")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key part")
        parts = key.split(".")
        kind = _leaf_type(Config, parts)
        if kind in (str, str | None) and raw not in ("null", "~"):
            value: Any = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
        if isinstance(value, str) and _FLOAT.fullmatch(value):
            value = float(value)  # YAML 1.1 reads "1e-5" as a string
        if isinstance(value, dict) and get_origin(kind) is dict:
            value = Whole(value)  # resources={solo: 1}: exactly that, not merged with the recipe's
        node: Any = tree
        for i, part in enumerate(parts[:-1]):  # algo.loss=dapo algo.loss.clip_high=..: a choice
            node = node.get(part, {}) if isinstance(node, dict) else node
            if not isinstance(node, dict) and ".".join(parts[: i + 1]) not in choices():
                raise ConfigError(f"override {key!r} conflicts with another override")
        for part in reversed(parts):
            value = {part: value}
        tree = merge(tree, value)  # as a recipe's keys: a choice's name and parameters combine
    return tree


def _leaf_type(model: type[BaseModel] | None, parts: list[str]) -> Any:
    """The annotation of the field at ``parts`` through sections (None where there is none)."""
    *sections, leaf = parts
    for part in sections:
        field = model.model_fields.get(part) if model is not None else None
        model = section_class(field.annotation) if field is not None else None
    field = model.model_fields.get(leaf) if model is not None else None
    return field.annotation if field is not None else None


def section_class(ann: Any) -> type[BaseModel] | None:
    """The section class of a field typed ``Section`` or ``Section | None`` (else None)."""
    optional = get_origin(ann) in (Union, UnionType)
    args = [a for a in get_args(ann) if a is not type(None)] if optional else [ann]
    ok = len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel)
    return args[0] if ok else None


def merge(base: dict[str, Any], extra: dict[str, Any], _at: str = "") -> dict[str, Any]:
    """Recursive dict merge; ``extra`` wins. Lists and scalars are replaced whole. A choice
    (``algo.loss``) written as a bare name is ``{name: ...}``, and one that names another
    variant starts from that variant's defaults, never the old variant's parameters (a
    harness keeps its session knobs: ``agent.harness.name=my.py:agent`` on a recipe's)."""
    out = dict(base)
    for k, v in extra.items():
        old, at = out.get(k), f"{_at}{k}"
        if at in choices():
            old, v = ({"name": x} if isinstance(x, str) else x for x in (old, v))  # loss=dapo
            names = {d.get("name") for d in (old, v) if isinstance(d, dict)} - {None}
            if len(names) == 2:  # another variant: its own defaults
                old = {n: x for n, x in old.items() if at == "agent.harness" and n in KNOBS}
        both = isinstance(v, dict) and isinstance(old, dict) and not isinstance(v, Whole)
        out[k] = type(old)(merge(old, v, at + ".")) if both else v
    return out


class Whole(dict):
    """A mapping an override gives for a free-form mapping field (``key={a: 1}``): it replaces
    the recipe's value, as a list does; ``key.a=1`` still sets one entry."""


def _is_choice(field: Any) -> bool:
    return any(isinstance(m, Discriminator) for m in field.metadata)


@functools.cache
def choices(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, tuple]:
    """Every choice field (a union keyed on ``name``) in the config tree: dotted key ->
    (variant class by name, the default name)."""
    found: dict[str, tuple] = {}
    for name, field in (model or Config).model_fields.items():
        ann = field.annotation
        if _is_choice(field):
            variants = {a.__metadata__[0].tag: a.__origin__ for a in get_args(ann)}
            variants.pop("user")  # user code: any name with a ':'
            found[prefix + name] = (variants, field.get_default(call_default_factory=True).name)
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            found |= choices(ann, f"{prefix}{name}.")
    return found


BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def _located(loc: tuple, data: Any) -> str:
    """``loc`` as a dotted key; a list entry with a ``name`` is shown by it
    (``data.sources[math].weight``), others by index."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int) and parts:
            entry = data[p] if isinstance(data, list) and p < len(data) else None
            name = entry.get("name") if isinstance(entry, dict) else None
            parts[-1] += f"[{name}]" if isinstance(name, str) and name else f"[{p}]"
        else:
            parts.append(str(p))
        data = data[p] if isinstance(data, dict | list) and _has(data, p) else None
    return ".".join(parts)


def _choice_owners(key: str, data: Any) -> str | None:
    """For a knob of another variant of a choice: the line naming the variants that read it."""
    parent, _, leaf = key.rpartition(".")
    variants, default = choices().get(parent, ({}, None))
    owners = [name for name, cls in variants.items() if leaf in cls.model_fields]
    if not owners:
        return None
    for part in parent.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    chosen = data.get("name", default) if isinstance(data, dict) else default
    return (
        f"config {key}: {parent}.name={chosen} has no {leaf}; it is a parameter of "
        f"{', '.join(owners)} (set {parent}.name)"
    )


UNION_MEMBER = re.compile(r"(constrained-)?(float|int|str|bool)$|(literal|function-\w+)\[")


def _untagged(loc: tuple) -> tuple:
    """``loc`` without the variant tag pydantic puts after a choice field
    (``algo.loss.dapo.clip_high`` is ``algo.loss.clip_high``)."""
    out, tag_next = [], False
    for part in loc:
        if isinstance(part, str) and UNION_MEMBER.match(part):  # lr's float | "auto"
            continue
        if not tag_next:
            out.append(part)
        tag_next = not tag_next and ".".join(map(str, out)) in choices()
    return (*out,)


def _has(data: dict | list, key: Any) -> bool:
    return key in data if isinstance(data, dict) else isinstance(key, int) and key < len(data)


def format_validation_error(err: ValidationError, data: Any = None) -> str:
    """The first problem of a pydantic error as one line: key, value, reason. ``data`` (the
    validated tree) lets a list entry be named by its ``name``."""
    e = err.errors()[0]
    key = _located(_untagged(tuple(e["loc"])), data)
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "union_tag_invalid":  # a choice's unknown name
        names = e["ctx"]["expected_tags"].replace("'", "").removesuffix(", user")
        return (
            f"config {key}.name={e['ctx']['tag']!r}: not one of {names}, nor"
            " path/to/file.py:object or package.module:object"
        )
    if e["type"] in BOUNDS:  # "must be > 0", not pydantic's "Input should be greater than 0"
        msg = f"must be {BOUNDS[e['type']]} {next(iter(e.get('ctx', {}).values()), '')}".strip()
    elif e["type"] == "missing":
        msg = "is required; set it"
    if e["type"] == "extra_forbidden" and (owners := _choice_owners(key, data)):
        return owners
    if e["type"] == "extra_forbidden":
        near = nearest_keys(key)
        hint = f"did you mean {' or '.join(near)}?" if near else "check the spelling"
        return f"unknown config key {key!r}; {hint} (rlpost config --keys lists every key)"
    if msg.startswith("name="):  # a user part's file or object is missing
        return f"config {key}.{msg}"
    if not key or msg.startswith(key + "."):  # the validator already named the key
        return msg
    value = e.get("input")
    shown = "" if isinstance(value, dict) else f"={value!r}"
    return f"config {key}{shown}: {msg}"


def nearest_keys(key: str, n: int = 3) -> list[str]:
    """Valid dotted keys closest to ``key`` (difflib), nearest first."""
    import difflib

    keys = [k for k, _, _ in describe_fields()]
    if "." not in key:  # a section name ("rolout")
        keys = list(dict.fromkeys(k.split(".")[0] for k in keys))
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]  # right key, wrong section
    near = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
    return list(dict.fromkeys(same_leaf + near))[:n]


RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
"""The recipes installed with the package (``rlpost recipes`` lists them)."""


def shipped_recipes() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(name: str | Path, relative_to: Path | None = None) -> Path:
    """A recipe file: ``name`` as a path (relative to ``relative_to`` first, for ``base:``),
    else the shipped recipe of that name (``dapo_arith``, ``dapo_arith.yaml`` and
    ``recipes/dapo_arith.yaml`` all name it), so recipes work from any directory."""
    p = Path(name)
    for candidate in ([relative_to / p] if relative_to is not None else []) + [p]:
        if candidate.is_file():
            return candidate
    stem = p.name.removesuffix(".yaml")
    shipped = RECIPES_DIR / f"{stem}.yaml"
    if shipped.is_file() and (len(p.parts) == 1 or p.parent.name == "recipes"):
        return shipped
    import difflib

    names = [r.stem for r in shipped_recipes()]
    near = difflib.get_close_matches(stem, names, n=2)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise ConfigError(f"recipe {str(p)!r} does not exist{hint} (rlpost recipes lists them)")


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe as a dict. ``base: other.yaml`` (relative to the recipe, or a shipped recipe)
    is loaded first and this recipe's keys are merged on top, so variants state only what
    differs."""
    p = resolve_recipe(path)
    if p.resolve() in _seen:
        raise ConfigError(f"recipe {str(p)!r} includes itself through 'base'")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" line {line + 1}" if line is not None else ""
        raise ConfigError(f"recipe {str(p)!r}{where} is not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {str(p)!r} must be a mapping of sections")
    base = data.pop("base", None)
    if base is not None:
        base_path = resolve_recipe(str(base), relative_to=p.parent)
        data = merge(read_recipe(base_path, (*_seen, p.resolve())), data)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a recipe (None: defaults only), apply dotted overrides, validate the whole tree."""
    data = read_recipe(path) if path is not None else {}
    data = merge(data, parse_overrides(overrides or []))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, data)) from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written into the run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe_fields(
    model: type[BaseModel] = Config, prefix: str = "", values: BaseModel | None = None
) -> list[tuple[str, str, str]]:
    """(dotted key, value, help) for every leaf field: the default, or the value in ``values``
    (a loaded config) when given; used by ``rlpost config --keys``."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        sub = getattr(values, name) if values is not None else None
        default = field.get_default(call_default_factory=True)
        if _is_choice(field):  # the chosen variant's keys only; its name gets the choice's help
            chosen = sub if values is not None else default
            own = describe_fields(type(chosen), key + ".", chosen)
            own += [(f"{key}.{k}", repr(v), "") for k, v in (chosen.model_extra or {}).items()]
            rows.extend((k, v, h or field.description or "") for k, v, h in own)
        elif section_class(ann) and (values is None or sub is not None):  # optional: when set
            rows.extend(describe_fields(section_class(ann), key + ".", sub))
        else:
            value = sub if values is not None else default
            if isinstance(value, BaseModel | list | tuple):
                value = _plain(value)
            rows.append((key, repr(value), field.description or ""))
    return rows


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value
