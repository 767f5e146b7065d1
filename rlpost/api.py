"""rlpost's Python API: a policy you sample from and train, one call at a time.

    import rlpost
    base = rlpost.Base.load("path/to/model")              # an HF directory or a GGUF; None: tiny
    policy = base.policy(lora=rlpost.LoRA(rank=16))       # an adapter on the shared base
    out = policy.sample([prompt_ids], rlpost.SamplingParams(max_tokens=32), n=8)
    policy.forward_backward(data, "ppo_clip")             # gradients accumulate ...
    policy.optim_step(lr=1e-4)                            # ... until the step

The calls are the trainer's (:class:`rlpost.train.actor.PolicyTrainer`: losses, micro-batches,
clip, AdamW) and the in-process engine's; :func:`train` runs the whole pipeline. The CLI and
the Tinker service (:mod:`rlpost.tinker`) are faces over this module (docs/extending.md).

A :class:`Datum` is ``tokens`` and, at each position ``i``, the ``target`` scored after
``tokens[: i + 1]``, its weight and per-token inputs. A list of them is a
:class:`~rlpost.train.batch.TrainBatch` whose one-token prompt is ``tokens[0]`` and whose
response is the targets, so every policy loss applies as is. Each LoRA policy of a
:class:`Base` is a named peft adapter on its weights; :attr:`Base.lock` runs one computation at
a time with that adapter active. A full fine-tune gets its own copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
import threading
import types
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlpost.algos.policy_losses import POLICY_LOSSES
from rlpost.config import OptimConfig
from rlpost.models.loading import load_policy
from rlpost.params import LossChoice, variants
from rlpost.registry import declared
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.statefile import load_state, save_state
from rlpost.train.actor import ActorSettings, PolicyTrainer
from rlpost.train.batch import TrainBatch, compute_logprobs, model_device
from rlpost.types import Completion

__all__ = ["Base", "Datum", "ForwardBackward", "LoRA", "Policy", "Sampler", "SamplingParams"]

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class APIError(ValueError):
    """A call's input is wrong; the message names the field (``data[3].weights: ...``)."""


@dataclass(frozen=True)
class LoRA:
    """A LoRA adapter: ``W + (alpha / rank) B A`` on the chosen layers."""

    rank: int = 32
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False

    def targets(self) -> list[str]:
        out = [*(ATTN if self.train_attn else ()), *(MLP if self.train_mlp else ())]
        return out + (["lm_head"] if self.train_unembed else [])


@dataclass(frozen=True)
class Datum:
    """One sequence: ``targets[i]`` is scored after ``tokens[: i + 1]`` with ``weights[i]``
    (None: 1 everywhere); ``inputs``: per-position floats by name (``logprobs``: the
    sampler's, the behaviour policy of a ratio; ``advantages``)."""

    tokens: Sequence[int]
    targets: Sequence[int]
    weights: Sequence[float] | None = None
    inputs: dict[str, Sequence[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardBackward:
    """``loss``: the summed loss of the call; ``logprobs``: each datum's per-position
    logprobs of its targets (float32, before the step); ``stats``: the loss's statistics."""

    loss: float
    logprobs: list[torch.Tensor]
    stats: dict[str, float]


def datum_batch(data: Sequence[Datum], pad_id: int, context: int | None = None) -> TrainBatch:
    """``data`` as a :class:`TrainBatch` with a one-token prompt; :class:`APIError` naming
    the first datum and field that is wrong."""
    if not data:
        raise APIError("data: empty; give at least one datum")
    width = max(len(d.tokens) for d in data)
    rows: dict[str, list[list[float]]] = {k: [] for k in ("ids", "attn", "tgt", "w", "lp", "adv")}
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise APIError(f"data[{i}].tokens: empty")
        if context is not None and n + 1 > context:
            raise APIError(f"data[{i}].tokens: {n} tokens, past the model's context of {context}")
        per = {"targets": d.targets, "weights": d.weights, **dict(d.inputs)}
        for name, values in per.items():
            if values is not None and len(values) != n:
                raise APIError(f"data[{i}].{name}: {len(values)} values for {n} tokens")
            if values is not None and name != "targets" and not all(map(math.isfinite, values)):
                raise APIError(f"data[{i}].{name}: not finite (NaN or inf)")
        pad = width - n
        rows["ids"].append([*d.tokens, d.targets[-1]] + [pad_id] * pad)
        rows["attn"].append([1] * (n + 1) + [0] * pad)
        rows["tgt"].append([*d.targets] + [pad_id] * pad)
        rows["w"].append([*(d.weights if d.weights is not None else [1.0] * n)] + [0.0] * pad)
        for key, name in (("lp", "logprobs"), ("adv", "advantages")):
            rows[key].append([*d.inputs.get(name, [0.0] * n)] + [0.0] * pad)
    ids, attn = torch.tensor(rows["ids"]), torch.tensor(rows["attn"])
    lp = torch.tensor(rows["lp"], dtype=torch.float32)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        responses=torch.tensor(rows["tgt"]),
        response_mask=torch.tensor(rows["w"], dtype=torch.float32),
        group=torch.arange(len(data)),
        rollout_logprobs=lp,
        scores=torch.zeros(len(data)),
        token_versions=torch.zeros(len(data), width, dtype=torch.long),
        prompt_width=1,
        old_logprobs=lp if all("logprobs" in d.inputs for d in data) else None,
        advantages=torch.tensor(rows["adv"], dtype=torch.float32),
    )


def _rows(values: torch.Tensor, data: Sequence[Datum]) -> list[torch.Tensor]:
    return [values[i, : len(d.tokens)].to("cpu", copy=True) for i, d in enumerate(data)]


def resolve_loss(loss: str | Any | Callable, params: dict[str, Any]) -> tuple[Callable, Any]:
    """(function, params) of a registered loss name, a user's ``file.py:fn`` or
    ``package.module:fn``, a loss variant, or a function ``fn(x: LossInputs, params) ->
    PolicyLossOutput``; a user's function gets ``params`` as attributes (or its declared
    params model's instance, :func:`rlpost.registry.part`)."""
    if isinstance(loss, str) and ":" not in loss:
        choices = variants(LossChoice)
        if loss not in choices:
            raise APIError(f"loss={loss!r}: unknown; valid: {', '.join(sorted(choices))}")
        try:
            return POLICY_LOSSES.get(loss), choices[loss](**params)
        except ValueError as exc:  # pydantic: a wrong or unknown parameter
            raise APIError(f"loss={loss!r}: {' '.join(str(exc).split())}") from None
    if hasattr(loss, "name") and hasattr(loss, "model_dump"):  # a variant
        return POLICY_LOSSES.get(loss.name), loss
    if isinstance(loss, str):
        try:
            loss = POLICY_LOSSES.get(loss)
        except (ValueError, KeyError) as exc:
            raise APIError(f"loss={loss!r}: {exc}") from None
    if not callable(loss):
        raise APIError(f"loss={loss!r}: give a registered name, a variant or a function")
    model = declared(loss)[0]
    try:
        return loss, model(**params) if model is not None else types.SimpleNamespace(**params)
    except ValueError as exc:
        raise APIError(f"loss params: {' '.join(str(exc).split())}") from None


class Base:
    """A base model loaded once, shared by every :class:`Policy` made from it."""

    def __init__(
        self, model: torch.nn.Module, tokenizer, path: str | None, seed: int = 0, engine="hf"
    ) -> None:
        self.model, self.tokenizer, self.path, self.seed = model, tokenizer, path, seed
        self.model.requires_grad_(False)
        self.lock = threading.RLock()
        self.peft = None  # the peft wrapper once an adapter exists
        self._engine: HFEngine | None = None  # over the engines' view, rebuilt on change
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.sampling, self._vllm = engine, None  # what samples: hf, or vllm (built on use)
        if engine == "vllm" and not (path and Path(path).is_dir()):
            raise APIError(f"engine=vllm: serves an HF model directory, not {path!r}")

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        dtype: str = "float32",
        seed: int = 0,
        device: str = "cpu",
        engine: str = "hf",
    ) -> Base:
        """The model at ``path`` (an HF directory or a GGUF file; None: the built-in tiny one)
        on ``device`` (``auto``: cuda where there is one, as ``run.device``); samplers run on
        ``engine``: hf (in process) or vllm (an HF directory; each adapter a LoRA request)."""
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        model, tokenizer = load_policy(path, seed=seed, dtype=dtype)
        return cls(model.to(device), tokenizer, None if path is None else str(path), seed, engine)

    def policy(self, lora: LoRA | None = LoRA(), *, seed: int = 0, lr: float = 1e-4) -> Policy:
        """A new policy: a fresh adapter on this base (``lora``), or a full copy (None)."""
        with self.lock:
            if lora is None:
                dtype = str(self.model.dtype).removeprefix("torch.")
                model, _ = load_policy(self.path, seed=self.seed, dtype=dtype)
                return Policy(self, model, None, seed=seed, lr=lr)
            name = f"a{uuid.uuid4().hex[:12]}"
            self._add_adapter(name, lora)
            self.peft.set_adapter(name)
            return Policy(self, self.model, name, seed=seed, lr=lr, lora=lora)

    def estimate_bytes(self, lora: LoRA | None) -> int:
        """What a new policy adds: the adapter (or a full copy), its gradient and AdamW's
        two moments, in float32."""
        if lora is None:
            return 16 * sum(p.numel() for n, p in self.model.named_parameters() if "lora_" not in n)
        targets = set(lora.targets())
        return 16 * sum(
            lora.rank * (m.in_features + m.out_features)
            for name, m in self.model.named_modules()
            if name.rsplit(".", 1)[-1] in targets and hasattr(m, "in_features")
        )

    def _add_adapter(self, name: str, lora: LoRA) -> None:
        import peft

        cfg = peft.LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.targets(), bias="none"
        )
        with warnings.catch_warnings():  # peft asks transformers a deprecated property
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            if self.peft is None:
                self.peft = peft.get_peft_model(self.model, cfg, adapter_name=name)
            else:
                self.peft.add_adapter(name, cfg)
        self._engine = None

    def drop_adapter(self, name: str) -> None:
        with self.lock:
            self.peft.delete_adapter(name)
            self._engine = None

    def vllm(self):
        """The vLLM engine over this base's directory, with LoRA adapters served unmerged."""
        if self._vllm is None:
            from rlpost.rollout.engines.vllm import VLLMEngine

            dtype = str(self.model.dtype).removeprefix("torch.")
            lora = {"enable_lora": True, "max_lora_rank": 64, "max_loras": 4}
            self._vllm = VLLMEngine(self.path, self.tokenizer, seed=self.seed, dtype=dtype,
                                    max_model_len=self.context, extra=lora)  # fmt: skip
        return self._vllm

    def close(self) -> None:
        """Shut down what this base started: vLLM's engine core, a process of its own."""
        if self._vllm is not None:
            self._vllm.close()

    def engine(self, adapter: str | None) -> HFEngine:
        """The engine with ``adapter`` active (None: the base alone). Its module is a tree of
        its own over the same weights, so the engine's head and mode leave training alone."""
        if self._engine is None:
            memo = {
                id(p): torch.nn.Parameter(p.detach(), requires_grad=False)
                for p in self.model.parameters()
            }
            self._engine = HFEngine(copy.deepcopy(self.model, memo), self.tokenizer, seed=self.seed)
        if self.peft is not None:
            _activate(self._engine.model, adapter)
        return self._engine


def _activate(model: torch.nn.Module, adapter: str | None) -> None:
    """Make ``adapter`` the one LoRA adapter ``model``'s layers apply (None: none)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(adapter is not None)
            if adapter is not None:
                module.set_adapter(adapter)
    model.requires_grad_(False)


class Policy:
    """A trainable policy: :meth:`forward`, :meth:`forward_backward`, :meth:`optim_step`,
    :meth:`sample`, :meth:`snapshot`, :meth:`save_state` / :meth:`load_state`."""

    def __init__(
        self, base: Base, model, adapter: str | None, *, seed: int, lr: float, lora=None
    ) -> None:
        self.base, self.model, self.adapter, self.lora, self.seed = base, model, adapter, lora, seed
        self.id = adapter or f"f{uuid.uuid4().hex[:12]}"
        settings = ActorSettings(
            optim=OptimConfig(lr=lr, warmup_steps=0, weight_decay=0.0),
            mini_batch_size=1 << 30,
            micro_batch_size=8,
        )
        with self._active():
            self.trainer = PolicyTrainer(
                model, variants(LossChoice)["ppo_clip"](), settings, seed=seed
            )
        self.pending = 0  # forward_backward calls since the last step
        self.steps = 0

    @contextlib.contextmanager
    def _active(self):
        """The base's lock, with this policy's adapter the active (and trainable) one."""
        with self.base.lock:
            if self.adapter is not None:
                self.base.peft.set_adapter(self.adapter)  # its weights alone take gradients
            yield

    def _batch(self, data: Sequence[Datum]) -> TrainBatch:
        return datum_batch(data, self.base.tokenizer.pad_token_id or 0, self.base.context)

    def forward(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's per-position logprobs of its targets (no gradient)."""
        batch = self._batch(data)
        with self._active():
            return _rows(self.trainer.old_logprobs(batch), data)

    def forward_backward(
        self, data: Sequence[Datum], loss: Any = "ppo_clip", *, agg: str = "token-mean", **params
    ) -> ForwardBackward:
        """Add the gradients of ``loss`` on ``data`` to this policy's; the loss's value,
        the data's logprobs and the loss statistics. ``agg``: the reduction
        (:mod:`rlpost.algos.aggregate`; ``token-sum`` sums over tokens and data)."""
        fn, variant = resolve_loss(loss, params)
        batch = self._batch(data)
        with self._active():
            seen = torch.zeros_like(batch.response_mask, device=model_device(self.model))
            stats = self.trainer.accumulate(batch, (fn, variant), agg=agg, record=seen)
        self.pending += 1
        return ForwardBackward(stats.pop("loss"), _rows(seen, data), stats)

    def optim_step(
        self,
        lr: float | None = None,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
    ) -> dict[str, float]:
        """One AdamW step with the gradients accumulated since the last (which it zeroes);
        ``grad_clip`` None: no clipping. :class:`APIError` when there are none."""
        if self.pending == 0:
            raise APIError("optim_step: no gradients accumulated; call forward_backward first")
        with self._active():
            for group in self.trainer.optimizer.param_groups:
                group.update(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
                if lr is not None:
                    group["lr"] = lr
            self.trainer.scheduler.base_lrs = [g["lr"] for g in self.trainer.optimizer.param_groups]
            out = self.trainer.apply_step(math.inf if grad_clip is None else grad_clip)
        self.pending, self.steps = 0, self.steps + 1
        return out

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1
    ) -> list[Completion]:
        """``n`` completions of each prompt from the policy as it is now."""
        sampler = self.snapshot(keep=False)
        try:
            return sampler.sample(prompts, params, n)
        finally:
            sampler.close()

    def snapshot(self, keep: bool = True) -> Sampler:
        """A sampler of the policy as it is now; later steps leave it as it is. LoRA: a
        copy of the adapter alone on the shared base (``keep``: until :meth:`Sampler.close`)."""
        with self._active():
            if self.adapter is None:
                return Sampler(
                    self.base, None, model=copy.deepcopy(self.model).requires_grad_(False)
                )
            if not keep:
                return Sampler(self.base, self.adapter)
            name = f"s{uuid.uuid4().hex[:12]}"
            self.base._add_adapter(name, self.lora)
            state = _adapter_state(self.base, self.adapter)
            _load_adapter_state(self.base, name, state)
            self.base.peft.set_adapter(self.adapter)
            return Sampler(self.base, name, owned=True)

    def state(self) -> dict[str, Any]:
        with self._active():
            weights = (
                _adapter_state(self.base, self.adapter)
                if self.adapter is not None
                else {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            )
            state = {"weights": weights, "trainer": self.trainer.state_dict(), "steps": self.steps}
            return state | {"lora": None if self.lora is None else self.lora.__dict__}

    def save_state(self, path: str | Path, optimizer: bool = True) -> Path:
        """The weights (the adapter alone for LoRA) and, with ``optimizer``, AdamW's state."""
        state = self.state()
        if not optimizer:
            state.pop("trainer")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_state(state, path / "state.pt")
        return path

    def load_state(self, path: str | Path, optimizer: bool = True) -> None:
        """What :meth:`save_state` wrote; ``optimizer``: AdamW's state too (else it starts
        afresh)."""
        state = load_state(Path(path) / "state.pt")
        with self._active():
            if self.adapter is not None:
                _load_adapter_state(self.base, self.adapter, state["weights"])
            else:
                self.model.load_state_dict(state["weights"])
            if optimizer and "trainer" in state:
                self.trainer.load_state_dict(state["trainer"])
        self.steps, self.pending = state["steps"], 0

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The base's state dict with this policy's adapter folded in (its own names)."""
        with self._active():
            if self.adapter is None:
                return {k: v.detach() for k, v in self.model.state_dict().items()}
            from rlpost.models.lora import merged_weights

            return merged_weights(self.base.peft)

    def export(self, out: str | Path, *, gguf: str | None = None, overwrite: bool = False) -> dict:
        """The policy (adapter merged) as an HF directory at ``out``, and a llama.cpp GGUF
        of type ``gguf`` beside it (``rlpost export``'s writer)."""
        from rlpost.models.export import export_model

        model, _ = load_policy(self.base.path, seed=self.base.seed)
        if self.lora is not None and self.lora.train_unembed:  # the head moved, the input did not
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.load_state_dict(self.merged_weights())
        out = Path(out)
        return export_model(model, self.base.tokenizer, out, gguf_type=gguf, overwrite=overwrite)

    def close(self) -> None:
        """Drop this policy's adapter (its snapshots stay until their own close)."""
        if self.adapter is not None:
            self.base.drop_adapter(self.adapter)


def _adapter_state(base: Base, name: str) -> dict[str, torch.Tensor]:
    import peft

    state = peft.get_peft_model_state_dict(base.peft, adapter_name=name)
    return {k: v.detach().clone() for k, v in state.items()}


def _load_adapter_state(base: Base, name: str, state: dict[str, torch.Tensor]) -> None:
    import peft

    result = peft.set_peft_model_state_dict(base.peft, state, adapter_name=name)
    missing = [k for k in result.missing_keys if f".{name}." in k]
    if missing or result.unexpected_keys:
        raise APIError(
            f"adapter state does not fit: missing {missing[:3]}, unexpected "
            f"{list(result.unexpected_keys)[:3]}"
        )


class Sampler:
    """Samples and scores with a fixed policy: an adapter on the shared base (``adapter``),
    the base alone (None), or a full model of its own (``model``)."""

    def __init__(self, base: Base, adapter: str | None, *, model=None, owned: bool = False):
        self.base, self.adapter, self.model, self.owned = base, adapter, model, owned
        self.lora, self.files = None, None  # on vLLM: the adapter's request and files

    def _lora(self):
        """The adapter as a vLLM LoRA request: its files alone move to the engine."""
        if self.adapter is not None and self.lora is None:
            from vllm.lora.request import LoRARequest

            self.files = tempfile.TemporaryDirectory(prefix="rlpost-lora-")
            with self.base.lock:  # peft writes a named adapter into a folder of its name
                self.base.peft.save_pretrained(self.files.name, selected_adapters=[self.adapter])
            # vLLM caches an adapter by its int id: a new one per snapshot
            ident = 1 + (uuid.uuid4().int >> 98)
            self.lora = LoRARequest(self.adapter, ident, f"{self.files.name}/{self.adapter}")
        return self.lora

    def _engine(self) -> HFEngine:
        if self.model is None:
            return self.base.engine(self.adapter)
        if not isinstance(self.model, HFEngine):
            self.model = HFEngine(self.model, self.base.tokenizer, seed=self.base.seed)
        return self.model

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1
    ) -> list[Completion]:
        """``n`` completions of each prompt: token ids, their logprobs, the finish reason."""
        for i, p in enumerate(prompts):
            if not p:
                raise APIError(f"prompts[{i}]: empty")
            if self.base.context is not None and len(p) + params.max_tokens > self.base.context:
                raise APIError(
                    f"prompts[{i}]: {len(p)} tokens + max_tokens {params.max_tokens} pass the "
                    f"model's context of {self.base.context}"
                )
        if self.base.sampling == "vllm" and self.model is None:
            return self.base.vllm().generate(prompts, params, n=n, lora=self._lora())
        with self.base.lock:
            return self._engine().generate(prompts, params, n=n)

    def forward(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's per-position logprobs of its targets under this sampler's policy."""
        batch = datum_batch(data, self.base.tokenizer.pad_token_id or 0, self.base.context)
        with self.base.lock:
            values = compute_logprobs(
                self._engine().model, batch, temperature=1.0, micro_batch_size=8
            )
        return _rows(values, data)

    def close(self) -> None:
        if self.lora is not None:
            self.base.vllm().llm.llm_engine.remove_lora(self.lora.lora_int_id)
            self.files.cleanup()
            self.lora = None
        if self.owned:
            self.base.drop_adapter(self.adapter)
            self.owned = False


def train(config: Any = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The whole pipeline, as ``rlpost train``: ``config`` a recipe path or name, a
    :class:`rlpost.config.Config`, or None (the default recipe); the run's summary."""
    from rlpost.config import Config, load_config
    from rlpost.pipeline.loop import train as run

    cfg = config if isinstance(config, Config) else load_config(config, list(overrides))
    return run(cfg).summary
