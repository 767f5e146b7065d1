"""A stock ``vllm serve`` (vLLM's CPU build here) as rlpost's rollout server, on SmolLM2-135M.

The server is vLLM's own OpenAI server, started as :func:`rlpost.rollout.engines.vllm_server.serve_args`
and docs/rollout.md say; rlpost adds only its worker extension. After a push of new weights
through the server's routes, its logprobs of what it samples equal the trainer's
recomputation; a push it cannot trust is refused and it keeps serving; a seeded rollout at
``grpo_smollm2``'s sizes leaves it alive; and a GRPO run trains against it. Skipped when vLLM
is not importable unless ``RLPOST_REQUIRE_VLLM=1`` (deploy/vllm_env.sh makes an environment
that has it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.rollout.engines.remote import RemoteEngine
from rlpost.rollout.engines.vllm_server import VLLMServerSync, WeightFiles, serve_args
from rlpost.rollout.engines.vllm_worker import FROM_ENV, KEY_ENV, sign
from rlpost.sync import SyncError
from tests.conftest import TEST_ADMIN_KEY
from tests.integration.prom_util import free_port
from tests.integration.test_vllm_engine import PROMPT, TOLERANCE, _gap
from tests.real_model import smollm2_dir

if importlib.util.find_spec("vllm") is None and os.environ.get("RLPOST_REQUIRE_VLLM") != "1":
    pytest.skip(
        "vLLM is not installed here (bash deploy/vllm_env.sh makes an environment with it)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 900  # engine start on two shared CPU cores


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The base URL of a ``vllm serve`` on loopback: fp32, eager, a 1 GiB KV cache, vLLM's
    scheduling defaults (chunked prefill on, as docs/rollout.md starts it)."""
    port = free_port()
    args = serve_args(
        str(model_dir), port=port, dtype="float32", max_model_len=1024, extra=["--enforce-eager"]
    )
    env = {
        **os.environ,
        KEY_ENV: TEST_ADMIN_KEY,
        FROM_ENV: "127.0.0.1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),  # the worker extension imports rlpost
    }
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc, url: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve did not answer /health in {START_TIMEOUT_S} s")


def test_pushed_weights_match_trainer_after_prefix_cache_reset(server, tokenizer, model_dir):
    """The prompt's KV is cached under the old weights first; after a push of perturbed
    weights (pulled by the server from the trainer over HTTP), the server's logprobs of what
    it samples equal the trainer's under the new weights (and are far from the old weights'
    logprobs: the push took effect)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sync = VLLMServerSync([server], key=TEST_ADMIN_KEY)
    engine = RemoteEngine([server], tokenizer, weight_sync=sync)
    prompt = tokenizer(PROMPT)["input_ids"]
    try:
        engine.generate([prompt], SamplingParams(max_tokens=4, seed=3), n=2)  # caches the prompt
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
        start = time.perf_counter()
        engine.load_weights(model.named_parameters(), version=1)
        print(f"vllm serve: one push, pulled over HTTP: {time.perf_counter() - start:.2f} s")
        assert engine.version == 1
        assert engine.last_sync.committed == [server]
        out = engine.generate([prompt], SamplingParams(max_tokens=16, seed=4), n=4)
    finally:
        engine.close()
    assert all(c.policy_version == 1 for c in out)
    gap = _gap(model, out, tokenizer, temperature=1.0)
    print(f"vllm serve: max abs logprob gap after a push: {gap:.2e}")
    assert gap < TOLERANCE
    assert _gap(old, out, tokenizer, temperature=1.0) > 10 * TOLERANCE


def test_a_push_the_loader_cannot_trust_is_refused_and_the_server_serves_on(
    server, tokenizer, model_dir
):
    """``/collective_rpc`` takes no key: the loader refuses another address (blind SSRF), a
    local file, a wrong token, and tensors that are not the model's, each in one line, and
    the server still generates afterwards."""

    def load(source: str, token: str) -> list:
        body = {"method": "rlpost_load_weights", "args": [source, "7", token]}
        r = httpx.post(f"{server}/collective_rpc", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["results"]

    files = WeightFiles("127.0.0.1")
    url = files.offer("t", model_dir / "model.safetensors")  # the model's own weights
    try:
        cases = {
            "http://10.0.0.7:9/latest/meta-data": "not on the trainer's address",
            "/etc/passwd": "not on the trainer's address",
            str(model_dir / "model.safetensors"): "not on the trainer's address",
        }
        for source, why in cases.items():
            ((refused, line),) = load(source, sign(TEST_ADMIN_KEY, source, 7))
            assert refused == "refused" and why in line and "\n" not in line
        ((refused, line),) = load(url, sign("another key", url, 7))
        assert refused == "refused" and "token does not match" in line
        assert load(url, sign(TEST_ADMIN_KEY, url, 7))[0][0] == 7  # signed, the model's: taken
    finally:
        files.close()
    sync = VLLMServerSync([server], key=TEST_ADMIN_KEY)
    with pytest.raises(SyncError, match=r"model\.norm\.weight is F32\[577\]"):
        sync.push([("model.norm.weight", torch.ones(577))], version=8)
    with pytest.raises(SyncError, match=r"'lm_head\.bias' is not a tensor of the model"):
        sync.push([("lm_head.bias", torch.ones(3))], version=8)
    sync.close()
    engine = RemoteEngine([server], tokenizer)
    try:
        out = engine.generate([tokenizer(PROMPT)["input_ids"]], SamplingParams(max_tokens=4))
    finally:
        engine.close()
    assert len(out) == 1 and out[0].token_ids


def test_a_seeded_rollout_at_the_recipes_sizes_leaves_the_cpu_build_alive(server, tokenizer):
    """``grpo_smollm2``'s rollout, 8 prompts x 8 samples x 48 tokens with the run's seeds, twice,
    through the engine ``rollout.engine=remote rollout.engine.server=vllm`` builds: on the CPU
    build the seeds are left out (a seeded request after a chunked prefill kills its engine
    core), and the server answers every request and stays up."""
    from rlpost.config import RECIPES_DIR, load_config
    from rlpost.rollout.engines.remote import build

    cfg = load_config(
        RECIPES_DIR / "grpo_smollm2.yaml",
        ["rollout.engine=remote", "rollout.engine.server=vllm",
         f"rollout.engine.servers={json.dumps([server])}"],
    )  # fmt: skip
    r = cfg.rollout
    engine = build(cfg, None, None, tokenizer)
    assert [c.seeds for c in engine.clients] == [False]  # vLLM's CPU build
    prompts = [_chat(tokenizer, f"Compute {i} + {2 * i} = Reply with the number only.")
               for i in range(r.prompts_per_step)]  # fmt: skip
    # 64 prefills of this length pass vLLM's CPU budget of 2,048 tokens a step: chunked
    assert r.prompts_per_step * r.n * len(prompts[0]) > 2048
    params = SamplingParams(temperature=1.0, max_tokens=r.max_tokens, seed=cfg.run.seed)
    try:
        for _ in range(2):
            out = engine.generate(prompts, params, n=r.n)
            assert len(out) == r.prompts_per_step * r.n == 64
            assert all(c.token_ids for c in out)
    finally:
        engine.close()
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def _chat(tokenizer, text: str) -> list[int]:
    """``text`` as the run prompts it: through the model's chat template."""
    message = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def test_grpo_trains_against_vllm_serve(server, model_dir, tmp_path):
    """Three GRPO steps on SmolLM2 with vllm serve as the rollout server: each batch is
    sampled by the newest weights, and the served logprobs are the trainer's."""
    from rlpost.config import RECIPES_DIR, load_config
    from rlpost.pipeline.loop import train

    over = [
        f"model.path={model_dir}",
        "model.gradient_checkpointing=false",  # vLLM's transformers predates rlpost's hook
        "rollout.engine=remote",
        "rollout.engine.server=vllm",
        f"rollout.engine.servers={json.dumps([server])}",
        "rollout.prompts_per_step=2",
        "rollout.n=4",
        "rollout.max_tokens=16",
        "train.steps=3",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "sft.steps=0",
        "eval.every=0",
        "eval.limit=8",
        "checkpoint.every=0",
        "observe.progress=false",
        f"run.output_dir={tmp_path}",
    ]
    result = train(load_config(RECIPES_DIR / "grpo_smollm2.yaml", over))
    rows = [h for h in result.history if "loss" in h]
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    gaps = [r["logprob_gap"] for r in rows]
    print(f"GRPO against vllm serve: logprob_gap per step {gaps}")
    assert all(g < TOLERANCE for g in gaps)
