"""LoRA through peft: low-rank adapters trained on a frozen base model.

:func:`apply_lora` wraps the policy and the optimizer takes its trainable parameters; the
reference is the base under ``reference_mode(model)``; engines get :func:`merged_weights`;
:func:`save_adapters` writes peft's format. peft (extra ``[lora]``) is imported only here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASettings:
    """Adapter shape: ``W + (alpha / rank) * B @ A`` on each target linear layer."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGETS)


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs the [lora] extra: pip install 'rlpost[lora]'") from None
    return peft


def apply_lora(model: torch.nn.Module, settings: LoRASettings):
    """``model`` wrapped with fresh adapters (B = 0, so it starts as the base model exactly)."""
    peft = _peft()
    names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    targets = [t for t in settings.target_modules if t in names]
    if not targets:
        raise ValueError(
            f"none of the LoRA target modules {list(settings.target_modules)} is a linear layer "
            f"of this model; its linear layers are {sorted(names)}"
        )
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft asks transformers the deprecated is_gradient_checkpointing; not the user's to fix.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        return peft.get_peft_model(model, config)


@contextlib.contextmanager
def reference_mode(model) -> Iterator[None]:
    """The base model, adapters disabled: what a frozen reference copy would compute."""
    with model.disable_adapter():
        yield


def merged_weights(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in, the model left as it is."""
    peft = _peft()
    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and module.active_adapters:
            with torch.no_grad():
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            deltas[f"{name}.weight"] = delta
    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = (value + deltas[plain]).detach() if plain in deltas else value.detach()
    return out


def save_adapters(model, out_dir: Path) -> Path:
    """Write only the adapters (peft's format) to ``out_dir``."""
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def load_adapters(model, adapter_dir: Path) -> None:
    """Load adapters saved by :func:`save_adapters` into a model from :func:`apply_lora`."""
    peft = _peft()
    from safetensors.torch import load_file

    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    peft.set_peft_model_state_dict(model, state)
