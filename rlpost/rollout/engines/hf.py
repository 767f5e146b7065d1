"""The in-process transformers engine (on its model's device: CPU by default, or a GPU).

Not ``model.generate``, which prefills a group's prompt G times and returns no per-token
logprobs: here a prompt is prefilled once and its KV repeated G times. Finished rows leave the
batch once they are the majority.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable

import torch
from transformers import DynamicCache

from rlpost.resolved import ENGINES, RunFacts
from rlpost.rollout.engines.protocol import SamplingParams, TokenRate, sample_tokens
from rlpost.train.actor import eager_attention_pays
from rlpost.train.batch import keeps_logits
from rlpost.train.lm_head import bf16_serving, serve_head, serving_precision
from rlpost.types import Completion


class HFEngine(TokenRate):
    """Rollout engine around a transformers causal LM in this process."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        batch_size: int = 64,
        share_prefix: bool = True,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        self.model = serve_head(model)  # the decode step's head on the faster kernel
        self.model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.share_prefix = share_prefix
        self.version = version
        self.generator = torch.Generator().manual_seed(seed)
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the serving model")
            params[name].copy_(tensor)
        self.version = version

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1, group_offset: int = 0
    ) -> list[Completion]:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        per_chunk = max(1, self.batch_size // n)
        generator = (
            self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        )
        out: list[Completion] = []
        start = time.perf_counter()
        for lo in range(0, len(prompt_ids), per_chunk):
            chunk = prompt_ids[lo : lo + per_chunk]
            out.extend(self._generate_chunk(chunk, params, n, group_offset + lo, generator))
        self.seconds += time.perf_counter() - start
        return out

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, n: int, group_offset: int, generator
    ) -> list[Completion]:
        stop_ids = set(params.stop_token_ids) | {self.eos_id}
        stops = [t for t in params.stop_texts if t]
        # only the newest token completes a stop text: the last len(stop)+1 tokens hold it
        window = max((len(t) for t in stops), default=0) + 1
        ids, attn = self._left_pad(prompts)
        if not self.share_prefix:
            ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        last_only = {"logits_to_keep": 1} if keeps_logits(self.model) else {}
        inputs = {"input_ids": ids, "attention_mask": attn, "position_ids": pos}
        with serving_precision(self.model):
            out = self.model(**inputs, cache=cache, use_cache=True, **last_only)
        logits = out.logits[:, -1, :]
        if self.share_prefix and n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, 0)
            attn = attn.repeat_interleave(n, 0)
            pos = pos.repeat_interleave(n, 0)
        rows = len(prompts) * n
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        finished = [False] * rows
        # which original row each batch position holds
        active = torch.arange(rows, device=ids.device)
        last_pos = pos[:, -1]
        for _ in range(params.max_tokens):
            tok, lp = sample_tokens(logits, params, generator)
            tok_l, lp_l = tok.tolist(), lp.tolist()
            still = []
            for j, row in enumerate(active.tolist()):
                if finished[row]:
                    continue  # stays in the batch until compaction; its tokens ended at the stop
                tokens[row].append(tok_l[j])
                logps[row].append(lp_l[j])
                if tok_l[j] in stop_ids or (
                    stops and self._ends_with_stop(tokens[row][-window:], stops)
                ):
                    finished[row] = True
                else:
                    still.append(j)
            if not still:
                break
            if len(still) <= len(tok_l) // 2:
                keep = torch.tensor(still, device=ids.device)
                cache.batch_select_indices(keep)
                active, tok, attn, last_pos = active[keep], tok[keep], attn[keep], last_pos[keep]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=-1)
            last_pos = last_pos + 1
            inputs = {"input_ids": tok[:, None], "position_ids": last_pos[:, None]}
            with serving_precision(self.model):
                out = self.model(**inputs, attention_mask=attn, cache=cache, use_cache=True)
            logits = out.logits[:, -1, :]
        self.tokens_generated += sum(len(t) for t in tokens)
        return [
            Completion(
                prompt_ids=list(prompts[r // n]),
                token_ids=tokens[r],
                logprobs=logps[r],
                finish_reason="stop" if finished[r] else "length",
                policy_version=self.version,
                group=group_offset + r // n,
                text=self.tokenizer.decode(tokens[r], skip_special_tokens=True),
                token_versions=[self.version] * len(tokens[r]),
            )
            for r in range(rows)
        ]

    def _ends_with_stop(self, tail: list[int], stops: list[str]) -> bool:
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(t in text for t in stops)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        device = next(self.model.parameters()).device
        return ids.to(device), attn.to(device)

    def close(self) -> None:
        """Nothing to release: the model is a module of this process."""


def serving_copy(facts: RunFacts, model) -> torch.nn.Module:
    """The in-process engines' module, no grad, on the device: a copy, or (``shares_storage``)
    its own Parameter objects over the policy's memory (docs/performance.md, Memory)."""
    if facts.shares_storage:
        shared = {
            id(p): torch.nn.Parameter(p.detach(), requires_grad=False) for p in model.parameters()
        }
        serving = copy.deepcopy(model, shared)
    else:
        serving = copy.deepcopy(model)
    serving.requires_grad_(False)
    if facts.bf16:  # the trainer's numerics (autocast, its attention kernel), not wholly bf16
        bf16_serving(serving)
        if eager_attention_pays(serving):
            serving.set_attn_implementation("eager")
    return serving.to(torch.device(facts.device))


@ENGINES.register("hf", whole_batches=True, shares_storage=True)
def build(cfg, facts: RunFacts, model, tokenizer) -> HFEngine:
    """The batch engine for ``rollout.engine=hf``, serving ``model`` (or its memory)."""
    r, serving = cfg.rollout, serving_copy(facts, model)
    return HFEngine(
        serving, tokenizer, batch_size=r.batch_size, share_prefix=r.share_prefix, seed=cfg.run.seed
    )
