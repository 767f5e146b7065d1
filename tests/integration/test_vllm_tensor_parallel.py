"""``rollout.engine.tensor_parallel_size`` on the installed vLLM (its CPU build here): SmolLM2's
9 attention heads and 3 KV heads split over 3 ranks (3 heads and 1 KV head each); after a
push of new weights every rank serves its own shard of them, so vLLM's logprobs of what it
samples equal the trainer's recomputation. Skipped when vLLM is not importable unless
``RLPOST_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.vllm import VLLMEngine
from tests.integration.test_vllm_engine import PROMPT, TOLERANCE, _gap
from tests.real_model import smollm2_dir

if importlib.util.find_spec("vllm") is None and os.environ.get("RLPOST_REQUIRE_VLLM") != "1":
    pytest.skip(
        "vLLM is not installed here (bash deploy/vllm_env.sh makes an environment with it)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

TP = 3
# Each rank's KV cache (GiB) and its OpenMP threads: vLLM's CPU settings, read by its workers.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def test_tensor_parallel_ranks_load_their_shards_of_a_push():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(
        str(path),
        tokenizer,
        tensor_parallel_size=TP,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        extra={"enforce_eager": True, "distributed_executor_backend": "mp"},
    )
    try:
        prompt = tokenizer(PROMPT)["input_ids"]
        before = engine.generate([prompt], SamplingParams(max_tokens=4, seed=3), n=2)
        assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in before)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
        engine.load_weights(model.named_parameters(), version=1)
        out = engine.generate([prompt], SamplingParams(max_tokens=8, seed=4), n=4)
        assert all(c.policy_version == 1 for c in out)
        gap = _gap(model, out, tokenizer, temperature=1.0)
        print(f"tp={TP}: max abs logprob gap after a push: {gap:.2e}")
        assert gap < TOLERANCE
    finally:
        engine.close()
