"""``rollout.engine=vllm`` against the installed vLLM (its CPU build here), on SmolLM2-135M.

One test per call rlpost makes into vLLM (the engine arguments, ``SamplingParams``,
logprobs and their mode, ``collective_rpc`` weight loads, ``reset_prefix_cache``,
shutdown), each failing when that call's contract changes, and the property RL
needs: after a push of new weights, vLLM's logprobs of what it sampled equal the
trainer's recomputation. Skipped when vLLM is not importable unless
``RLPOST_REQUIRE_VLLM=1`` (deploy/vllm_env.sh makes an environment that has it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.vllm import VLLMEngine, engine_args, sampling_kwargs
from rlpost.train.batch import collate, compute_logprobs
from tests.real_model import smollm2_dir

if importlib.util.find_spec("vllm") is None and os.environ.get("RLPOST_REQUIRE_VLLM") != "1":
    pytest.skip(
        "vLLM is not installed here (bash deploy/vllm_env.sh makes an environment with it)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

# Small CPU footprint on a shared machine: vLLM's own settings.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 16}
PROMPT = "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
TOLERANCE = 1e-3  # per token, fp32 on both sides


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    engine = VLLMEngine(str(model_dir), tokenizer, seed=0, **ENGINE)
    yield engine
    engine.close()


def _prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


def _trainer_logprobs(model, completions, tokenizer, temperature: float):
    """(the trainer's recomputation [B, T], 0 on padding; the batch it laid out)."""
    batch = collate(completions, [0.0] * len(completions), tokenizer.pad_token_id or 0)
    lp = compute_logprobs(model, batch, temperature=temperature, micro_batch_size=8)
    return lp, batch


def _gap(model, completions, tokenizer, temperature: float) -> float:
    lp, batch = _trainer_logprobs(model, completions, tokenizer, temperature)
    mask = batch.response_mask.bool()
    return float((lp - batch.rollout_logprobs)[mask].abs().max())


# ------------------------------------------------------------------ contracts


def test_engine_args_are_vllms(model_dir):
    import vllm

    config = vllm.EngineArgs(**engine_args(str(model_dir), **ENGINE)).create_engine_config()
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert (
        config.parallel_config.worker_extension_cls
        == "rlpost.rollout.engines.vllm_worker.WeightLoader"
    )
    assert config.model_config.dtype == torch.float32


def test_sampling_params_fields_are_vllms():
    import vllm

    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, max_tokens=9, stop_token_ids=(2,), stop_texts=("END",)
    )
    ours = sampling_kwargs(params, 4, 11)
    theirs = vllm.SamplingParams(**ours)
    for key, value in ours.items():
        assert getattr(theirs, key) == value, key


def test_generates_groups_with_own_logprobs(engine, tokenizer):
    prompt = _prompt(tokenizer)
    params = SamplingParams(max_tokens=12, seed=1)
    out = engine.generate([prompt, prompt[:-3]], params, n=3, group_offset=5)
    assert [c.group for c in out] == [5, 5, 5, 6, 6, 6]
    for c in out:
        assert 1 <= len(c.token_ids) <= 12
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 and lp == lp for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
        assert c.token_versions == [engine.version] * len(c.token_ids)
    assert engine.tokens_generated >= sum(len(c.token_ids) for c in out)
    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill


def test_seeded_requests_survive_a_chunked_prefill(engine, tokenizer):
    """A held-out evaluation sends seeded requests whose prompts together outgrow one
    scheduler step, so vLLM prefills some in chunks; on vLLM's CPU build a seeded request
    then died in the engine core ("CPU Generator does not use offset") and took the run
    with it. The engine must answer every prompt."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    long = (_prompt(tokenizer) * 40)[:400]
    prompts = [long[i:] for i in range(budget // len(long) + 3)]
    out = engine.generate(prompts, SamplingParams(max_tokens=3, seed=9))
    assert sorted({c.group for c in out}) == list(range(len(prompts)))
    assert all(1 <= len(c.token_ids) <= 3 for c in out)


def test_logprobs_are_of_the_tempered_distribution(engine, tokenizer, model_dir):
    """processed_logprobs: at T=2 the engine reports log softmax(logits / 2), which the
    trainer recomputes; raw logprobs (T=1) would be far off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine.load_weights(model.named_parameters(), version=engine.version)
    out = engine.generate(
        [_prompt(tokenizer)], SamplingParams(temperature=2.0, max_tokens=8, seed=2), n=2
    )
    assert _gap(model, out, tokenizer, temperature=2.0) < TOLERANCE
    assert _gap(model, out, tokenizer, temperature=1.0) > 10 * TOLERANCE


def test_pushed_weights_match_trainer_after_prefix_cache_reset(engine, tokenizer, model_dir):
    """The prompt's KV is cached under the old weights first; after the push, vLLM's logprobs
    of what it samples equal the trainer's recomputation under the new weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = _prompt(tokenizer)
    engine.generate([prompt], SamplingParams(max_tokens=4, seed=3), n=2)  # caches the prompt
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
    version = engine.version + 1
    engine.load_weights(model.named_parameters(), version=version)
    assert engine.version == version
    out = engine.generate([prompt], SamplingParams(max_tokens=16, seed=4), n=4)
    assert all(c.policy_version == version for c in out)
    gap = _gap(model, out, tokenizer, temperature=1.0)
    print(f"max abs logprob gap after a push: {gap:.2e}")
    assert gap < TOLERANCE


def test_reset_prefix_cache_answers_done(engine):
    assert engine.llm.reset_prefix_cache() is True


SCRIPT = """
import os, sys
from transformers import AutoTokenizer
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.vllm import VLLMEngine

if __name__ == "__main__":
    path = sys.argv[1]
    engine = VLLMEngine(path, AutoTokenizer.from_pretrained(path), dtype="float32",
                        max_model_len=256, max_num_seqs=4, extra={"enforce_eager": True})
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), n=1)
    engine.close()
    engine.close()
    print("tokens", len(out[0].token_ids))
"""


def test_close_shuts_down_without_leaks(model_dir, tmp_path):
    """A script that starts, uses and closes the engine exits 0, with no traceback and no
    shared memory left behind (Python's resource tracker reports leaked segments)."""
    script = tmp_path / "run_vllm.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 2" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "leaked shared_memory" not in proc.stderr, proc.stderr[-3000:]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("rlpost-weights-")]
