"""The PPO critic: a value model and the trainer that fits it to GAE returns.

The value model is a causal-LM decoder (the policy's own architecture, started
from a copy of its weights, as verl and OpenRLHF do) with a scalar head on the
final hidden state; the language-model head is dropped, so no ``[B, L, V]``
logits are ever computed. The head stays float32 whatever the backbone dtype.

The trainer mirrors :class:`rlpost.train.actor.PolicyTrainer`: epochs x
shuffled mini-batches (one optimizer step each) x micro-batches (gradient
accumulation), with loss denominators fixed per mini-batch by
:meth:`Aggregation.for_minibatch`, so the update does not depend on the
micro-batch size. The loss math is :func:`rlpost.algos.value.value_loss`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from rlpost.algos.aggregate import Aggregation
from rlpost.algos.value import value_loss
from rlpost.config import OptimConfig
from rlpost.rng import derive
from rlpost.train.actor import ActorSettings, bf16_autocast, build_optimizer
from rlpost.train.batch import TrainBatch, model_device, pad_responses, score_rows
from rlpost.train.optim import budget_slices, minibatch_updates, optimizer_step
from rlpost.train.packing import SHARING_MODES, Pack, pack_for, resolve_packing

HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """``V(s)`` for every prefix: a decoder backbone and a ``Linear(hidden, 1)`` head.

    ``backbone`` is a base (headless) transformer such as ``LlamaModel``, the
    ``get_decoder()`` of a causal LM. The head's weights start small
    (std ``1 / (hidden + 1)``, OpenRLHF's choice) and its bias at zero, so
    initial values are near 0 and the backbone receives gradient from step one."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        if head is None:
            head = nn.Linear(hidden, 1, dtype=torch.float32)
            nn.init.normal_(head.weight, mean=0.0, std=1.0 / (hidden + 1))
            nn.init.zeros_(head.bias)
        self.value_head = head

    @classmethod
    def from_policy(cls, policy: PreTrainedModel) -> ValueModel:
        """A value model whose backbone is a trainable copy of ``policy``'s decoder."""
        backbone = copy.deepcopy(policy.get_decoder())
        backbone.requires_grad_(True)
        backbone.train()
        return cls(backbone)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values ``[B, L]`` float32: entry ``l`` is the value of the prefix ``input_ids[:, : l + 1]``
        (``attention_mask`` None: rows packed, their boundaries set by ``position_ids``; or
        the 4-D mask of packed rows that share prompts)."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        hidden = out.last_hidden_state.to(self.value_head.weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # the head stays float32
            return self.value_head(hidden).squeeze(-1)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the backbone as an HF directory plus ``value_head.safetensors``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(out)
        head = {k: v.detach().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(head, str(out / HEAD_FILE))
        return out

    @classmethod
    def load(cls, directory: str | Path) -> ValueModel:
        """Read a directory written by :meth:`save_pretrained`."""
        d = Path(directory)
        if not (d / HEAD_FILE).is_file():
            raise FileNotFoundError(f"{str(d)!r} holds no {HEAD_FILE}; is it a saved value model?")
        backbone = AutoModel.from_pretrained(d, local_files_only=True)
        state = load_file(str(d / HEAD_FILE))
        head = nn.Linear(backbone.config.hidden_size, 1, dtype=state["weight"].dtype)
        head.load_state_dict(state)
        return cls(backbone, head)


def response_values(value_model: ValueModel, batch: TrainBatch, packed: Pack = Pack.PADDED):
    """Values ``[B, T]`` aligned with the responses, with gradient.

    Entry ``t`` is the value of the state before response token ``t`` (prompt
    plus ``responses[:, :t]``): positions ``P - 1 .. P + T - 2``, as
    :func:`rlpost.train.batch.response_logits`. Padding entries hold whatever the
    head outputs there (0 when ``packed``, the rows run end to end); mask them with
    ``response_mask``."""
    if packed:
        rows = pack_for(batch, value_model.backbone, packed)
        mask = rows.attention(value_model.backbone)
        return rows.scatter(rows.gather(value_model(rows.input_ids, mask, rows.position_ids)))
    values = value_model(batch.input_ids, batch.attention_mask, batch.position_ids)
    P = batch.prompt_width
    return values[:, P - 1 : -1]


class CriticTrainer:
    """Fits a :class:`ValueModel` to ``batch.returns`` with the clipped value loss."""

    def __init__(
        self,
        value_model: ValueModel,
        *,
        optim: OptimConfig,
        mini_batch_size: int = 64,
        micro_batch_size: int = 64,
        epochs: int = 1,
        clip_range: float | None = 0.2,
        loss_agg_mode: str = "token-mean",
        bf16: bool = False,
        seed: int = 0,
        max_tokens_per_micro_batch: int = 0,
        packing: str = "off",
    ) -> None:
        if micro_batch_size > mini_batch_size:
            raise ValueError(
                f"critic micro_batch_size={micro_batch_size} > mini_batch_size={mini_batch_size}"
            )
        Aggregation(loss_agg_mode)  # an unknown mode fails here, listing the valid ones
        self.model = value_model
        self.s = ActorSettings(
            optim=optim,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            epochs=epochs,
            loss_agg_mode=loss_agg_mode,
            bf16=bf16,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            packing=packing,
        )
        self.packed = resolve_packing(packing, value_model.backbone)
        self.whole_groups = packing in SHARING_MODES  # mini-batches of whole groups
        self.clip_range = clip_range
        self.optimizer, self.scheduler = build_optimizer(value_model, self.s)
        self.shuffle = torch.Generator().manual_seed(derive(seed, "critic_shuffle"))
        self.skipped_updates = 0

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Old values ``[B, T]`` float32 for GAE, zero on padding (no gradient)."""

        def fn(micro: TrainBatch) -> torch.Tensor:
            with bf16_autocast(self.model, self.s.bf16):
                return response_values(self.model, micro, self.packed).float()

        values = score_rows(
            self.model,
            batch,
            fn,
            micro_batch_size=self.s.micro_batch_size,
            max_tokens=self.s.max_tokens_per_micro_batch,
            packed=self.packed,
        ).cpu()
        return torch.where(batch.response_mask > 0, values, torch.zeros_like(values))

    def _micro_slices(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row ids of ``batch``'s micro-batches: by rows, or by the token budget."""
        rows, budget = torch.arange(len(batch)), self.s.max_tokens_per_micro_batch
        lens = batch.lengths()
        return budget_slices(
            rows,
            *lens,
            self.s.micro_batch_size,
            budget,
            packed=self.packed,
            groups=self.packed.groups(batch),
        )

    def _micro(self, micro: TrainBatch) -> TrainBatch:
        """A micro-batch under a token budget is trimmed to its own widths."""
        return micro.trimmed() if self.s.max_tokens_per_micro_batch > 0 else micro

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Epochs x mini-batches of critic steps on ``batch`` (needs ``returns`` and ``values``).

        Returns the means over updates of ``vf_loss``, ``vf_clip_frac``,
        ``vf_explained_var``, ``vpred_mean``, ``critic_grad_norm``, plus
        ``critic_lr`` and ``critic_updates``."""
        if batch.returns is None or batch.values is None:
            raise ValueError("critic update() needs batch.returns and batch.values (old values)")
        self.model.train()
        out = minibatch_updates(
            len(batch),
            self.s.mini_batch_size,
            self.s.epochs,
            self.shuffle,
            lambda rows: self._step(batch.select(rows).to(model_device(self.model))),
            groups=batch.group if self.whole_groups else None,
        )
        out["critic_updates"] = out.pop("updates")
        out["critic_lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _step(self, mb: TrainBatch) -> dict[str, float]:
        agg = Aggregation.for_minibatch(mb.response_mask, self.s.loss_agg_mode)
        preds = torch.zeros_like(mb.response_mask)

        def micro_loss(rows: torch.Tensor):
            micro = self._micro(mb.select(rows))
            with bf16_autocast(self.model, self.s.bf16):
                pred = response_values(self.model, micro, self.packed).float()
            out = self._loss(pred, micro, agg)
            preds[rows.to(preds.device)] = pad_responses(pred.detach(), preds.shape[1])
            return out.loss, {}

        params = list(self.model.parameters())
        outcome = optimizer_step(
            self.optimizer,
            self.scheduler,
            params,
            self.s.optim.grad_clip,
            self._micro_slices(mb),
            micro_loss,
        )
        # Statistics over the whole mini-batch (explained variance does not add up over parts).
        with torch.no_grad():
            whole = self._loss(preds, mb, agg)
        stats = {k: float(v) for k, v in whole.stats.items()}
        stats["vf_loss"] = outcome.loss
        stats["critic_grad_norm"] = outcome.grad_norm
        stats["critic_skipped"] = 1.0 if outcome.skipped else 0.0
        if outcome.skipped:
            self.skipped_updates += 1
        return stats

    def _loss(self, pred: torch.Tensor, batch: TrainBatch, agg: Aggregation):
        return value_loss(
            pred,
            batch.returns,
            batch.values,
            batch.response_mask,
            agg=agg,
            clip_range=self.clip_range,
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, the value model's weights included."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "shuffle": self.shuffle.get_state(),
            "skipped_updates": self.skipped_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle.set_state(state["shuffle"])
        self.skipped_updates = int(state["skipped_updates"])
