"""``rollout.engine=vllm``: vLLM's offline ``LLM`` in this process (GPU, extra ``[vllm]``).

vLLM brings what the CPU scheduler hand-writes, at GPU speed: continuous
batching, a paged KV cache, automatic prefix caching (a group's prompt is
prefilled once) and chunked prefill. This module only adapts it to the
rollout protocol:

* prompts go in as token ids, ``n = G`` per prompt, and ``logprobs=0`` returns
  the sampled token's logprob at each position. ``logprobs_mode=
  "processed_logprobs"`` (vLLM >= 0.10) makes those the tempered
  distribution the trainer recomputes (they also reflect top-k/top-p
  truncation when those are on; the ``rlvr`` preset keeps them off);
* weights are loaded in place on every worker through ``LLM.collective_rpc``
  calling the model's own ``load_weights`` (vLLM maps HF names, fused QKV and
  tensor-parallel shards), then the prefix cache is reset since its KV came
  from the old weights. The tensors are serialised to the workers, which is
  fine for models that fit one node; vLLM's NCCL/IPC weight-transfer engines
  are the faster path for large ones.

Nothing here runs without a GPU; importing the module is free, and building
an engine without vLLM raises a one-line ImportError naming the extra.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch

from rlpost.rollout.protocol import SamplingParams, TokenRate
from rlpost.types import Completion

MISSING = "rollout.engine=vllm needs the [vllm] extra: pip install 'rlpost[vllm]'"


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise ImportError(MISSING) from None
    return vllm


def _load_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker: copy ``weights`` into its model shard."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


class VLLMEngine(TokenRate):
    """Rollout engine around ``vllm.LLM``."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        version: int = 0,
    ) -> None:
        vllm = _import_vllm()
        # collective_rpc ships a function to the worker processes; vLLM only
        # pickles callables when this is set.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.version = version
        # vLLM seeds its own sampling; the generator is kept for the loop's checkpoints.
        self.generator = torch.Generator().manual_seed(seed)
        self.llm = vllm.LLM(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_seqs=256,
            logprobs_mode="processed_logprobs",
        )

    def _params(self, params: SamplingParams, n: int, seed: int | None):
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_texts) or None,
            include_stop_str_in_output=True,
            logprobs=0,
            seed=seed,
        )

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1, group_offset: int = 0
    ) -> list[Completion]:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        if params.seed is None:
            sampling = self._params(params, n, None)
        else:  # one seed per prompt, or every prompt would draw the same random stream
            sampling = [self._params(params, n, params.seed + i) for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        self.seconds += time.perf_counter() - start
        out = []
        for i, request in enumerate(outputs):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                # One dict per position; it always holds the sampled token.
                logprobs = [
                    float(pos[t].logprob) for pos, t in zip(sample.logprobs, ids, strict=True)
                ]
                reason = (
                    sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
                )
                out.append(
                    Completion(
                        prompt_ids=list(prompt_ids[i]),
                        token_ids=ids,
                        logprobs=logprobs,
                        finish_reason=reason,
                        policy_version=self.version,
                        group=group_offset + i,
                        text=sample.text,
                        token_versions=[self.version] * len(ids),
                    )
                )
                self.tokens_generated += len(ids)
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        weights = [(name, t.detach().cpu().contiguous()) for name, t in named_tensors]
        self.llm.collective_rpc(_load_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        """vLLM frees its engine when the LLM object goes; drop it."""
        self.llm = None


def build(cfg, tokenizer) -> VLLMEngine:
    """The vLLM engine for ``rollout.engine=vllm`` (serves ``model.path``)."""
    _import_vllm()
    r = cfg.rollout
    return VLLMEngine(
        str(cfg.model.path),
        tokenizer,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.max_model_len,
        dtype={"bfloat16": "bfloat16", "float32": "float32"}.get(cfg.model.dtype, "auto"),
        seed=cfg.run.seed,
    )
