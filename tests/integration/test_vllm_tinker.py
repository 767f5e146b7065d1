"""``rlpost tinker --engine vllm``: samplers on vLLM (its CPU build here), each saved adapter a
LoRA request on the one base vLLM loaded, never merged into it.

The official SDK trains an adapter on SmolLM2-135M, saves it for a sampler and samples: vLLM's
logprob of each sampled token equals the training client's ``forward`` of the same tokens, and
differs from the base's, so the adapter is what vLLM applied. Skipped when vLLM is not
importable unless ``RLPOST_REQUIRE_VLLM=1`` (deploy/vllm_env.sh makes an environment with it).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import psutil
import pytest

if importlib.util.find_spec("vllm") is None and os.environ.get("RLPOST_REQUIRE_VLLM") != "1":
    pytest.skip(
        "vLLM is not installed here (bash deploy/vllm_env.sh makes an environment with it)",
        allow_module_level=True,
    )

from tests.integration.test_tinker_service import KEY, _datum, start, stop, tinker, types
from tests.real_model import smollm2_dir

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
TOLERANCE = 1e-3  # per token, fp32 on both sides (as tests/integration/test_vllm_engine.py)


def _logprobs(client, tokens: list[int]) -> np.ndarray:
    out = client.forward([_datum(tokens)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_a_trained_adapter_samples_on_vllm_with_the_trainers_logprobs(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    proc, url = start(smollm2_dir(), tmp_path / "state", "--engine", "vllm")
    try:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
        prompt = tc.get_tokenizer().encode(PROMPT)
        text = tc.get_tokenizer().encode(PROMPT + "The sea is wide, deep and blue.")
        for _ in range(3):
            tc.forward_backward([_datum(text)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        base = service.create_sampling_client(base_model="tiny").result()
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3)
        out = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
        engines = psutil.Process(proc.pid).children(recursive=True)
        assert any("EngineCore" in c.name() for c in engines), engines  # vLLM sampled
        shifts = []
        for seq in out.sequences:
            assert len(seq.tokens) == len(seq.logprobs) >= 1
            full = prompt + list(seq.tokens)
            want = _logprobs(tc, full)[len(prompt) - 1 :]
            np.testing.assert_allclose(np.array(seq.logprobs), want, atol=TOLERANCE)
            plain = base.compute_logprobs(types.ModelInput.from_ints(full)).result()
            shifts.append(np.abs(np.array(plain[len(prompt) :]) - want).max())
        assert max(shifts) > 10 * TOLERANCE, shifts  # the base alone scores them otherwise
        # A second save is a new adapter in vLLM; the first sampler still serves its own.
        tc.forward_backward([_datum(text)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        newer = tc.save_weights_and_get_sampling_client().result()
        seq = newer.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        want = _logprobs(tc, prompt + list(seq.tokens))[len(prompt) - 1 :]
        np.testing.assert_allclose(np.array(seq.logprobs), want, atol=TOLERANCE)
        assert (
            len(sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences)
            == 1
        )
        service.close("success").result()
    finally:
        stop(proc)
    _, alive = psutil.wait_procs(engines, timeout=30)
    assert not alive, f"vLLM outlived the service: {alive}"  # its engine core is shut down
