"""The official ``tinker`` SDK, unmodified, against a real ``rlpost tinker`` on 127.0.0.1.

One contract test per SDK call the cookbook makes, the parity of a sampler's
``compute_logprobs`` with the training client's ``forward``, every built-in loss against its
formula written here, one ``importance_sampling`` step against ``rlpost train``'s update, bad input (a 4xx naming the field, the service still serving) and a
``save_state`` that survives ``kill -9``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")  # the [tinker] extra, installed by the test extra
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

KEY, OTHER = "tml-alice", "tml-bob"


def start(model_dir, state_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rlpost.tinker.service", "--model", f"tiny={model_dir}", *flags]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not lines or "listening on" not in lines[0]:
        proc.kill()
        raise RuntimeError(f"rlpost tinker did not start: {lines}")
    return proc, lines[0].split("listening on ")[1].split()[0]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tinker_state")


@pytest.fixture(scope="module")
def server(tiny_dir, state_dir):
    proc, url = start(tiny_dir, state_dir)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def trainer(service):
    return service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def _tokens(trainer, text="1+2=3 and 4+5=9") -> list[int]:
    return trainer.get_tokenizer().encode(text)


def test_info_capabilities_and_tokenizer(service, trainer, server, tiny_dir):
    info = trainer.get_info()
    assert info.model_id == trainer.model_id and info.is_lora and info.lora_rank == 4
    assert info.model_data.tokenizer_id == str(tiny_dir)
    assert trainer.get_tokenizer().decode(_tokens(trainer)) == "1+2=3 and 4+5=9"
    caps = tinker.RestClient(base_url=server, api_key=KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]


def test_forward_backward_optim_step_lowers_the_loss(trainer):
    tokens = _tokens(trainer)
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    first = trainer.forward_backward([datum], "cross_entropy").result()
    lp = first.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lp.shape == (len(tokens) - 1,) and (lp < 0).all()
    assert first.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result()
    assert step.metrics["grad_norm"] > 0
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01)).result()
    after = trainer.forward([datum], "cross_entropy").result()
    assert -after.loss_fn_outputs[0]["logprobs"].to_numpy().sum() < -lp.sum() - 1.0


def test_forward_backward_custom_matches_cross_entropy(service):
    a = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tokens = _tokens(a)
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))

    def nll(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"nll": float(loss.detach())}

    custom = a.forward_backward_custom([datum], nll).result()
    assert custom.metrics["loss:sum"] == pytest.approx(
        custom.metrics["surrogate_loss:sum"], rel=1e-5
    )
    builtin = a.forward([datum], "cross_entropy").result()
    lp = builtin.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert custom.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_sampler_parity_with_forward_and_sampling_fields(service, trainer):
    tokens = _tokens(trainer)
    saved = trainer.save_weights_for_sampler("parity").result()
    assert saved.path == f"tinker://{trainer.model_id}/sampler_weights/parity"
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(tokens)
    got = sampler.compute_logprobs(prompt).result()
    assert got[0] is None and len(got) == len(tokens)
    want = trainer.forward([_datum(tokens)], "cross_entropy").result()
    want = want.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(got[1:], dtype=np.float32), want, atol=1e-4)

    params = types.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=5)
    out = sampler.sample(prompt, 3, params, include_prompt_logprobs=True).result()
    assert len(out.sequences) == 3 and out.prompt_logprobs[1:] == pytest.approx(got[1:], abs=1e-5)
    for seq in out.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and 1 <= len(seq.tokens) <= 6
        assert seq.stop_reason in ("stop", "length") and all(lp <= 0 for lp in seq.logprobs)
    again = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]
    stop_on = out.sequences[0].tokens[0]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=5, stop=[stop_on]))
    first = stopped.result().sequences[0]
    assert first.stop_reason == "stop" or stop_on not in first.tokens
    quick = trainer.save_weights_and_get_sampling_client().result()
    assert quick.compute_logprobs(prompt).result()[1:] == pytest.approx(got[1:], abs=1e-5)
    base = service.create_sampling_client(base_model="tiny").result()
    assert len(base.sample(prompt, 1, params).result().sequences) == 1


def _reference(loss_fn: str, lp, old, adv, config) -> float:
    """Each built-in loss as Tinker's documentation writes it (tinker-docs.thinkingmachines.ai/losses)."""
    ratio = torch.exp(lp - old)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum())
    if loss_fn == "ppo":
        return float(-torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum())
    if loss_fn == "cispo":
        return float(-(torch.clamp(ratio, lo, hi).detach() * lp * adv).sum())
    if loss_fn == "dro":
        return float(-(lp * adv - 0.5 * config["beta"] * (lp - old) ** 2).sum())
    if loss_fn == "gspo":
        s = torch.exp((lp - old).mean() + lp - lp.detach())
        return float(-torch.min(s * adv, torch.clamp(s, lo, hi) * adv).sum())
    raise AssertionError(loss_fn)


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.3}),
        ("dro", {"beta": 0.3}),
        ("gspo", {}),
    ],
)
def test_each_builtin_loss_matches_its_formula(service, trainer, loss_fn, config):
    tokens = _tokens(trainer)
    n = len(tokens) - 1
    current = trainer.forward([_datum(tokens)], "cross_entropy").result()
    lp = torch.tensor(current.loss_fn_outputs[0]["logprobs"].to_numpy())
    gen = torch.Generator().manual_seed(len(loss_fn) + len(config))
    old = lp + 0.3 * torch.randn(n, generator=gen)  # ratios spread across the clip range
    adv = torch.randn(n, generator=gen)
    datum = _datum(tokens, logprobs=old.tolist(), advantages=adv.tolist())
    out = trainer.forward_backward([datum], loss_fn, config or None).result()
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp.numpy(), atol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(
        _reference(loss_fn, lp, old, adv, config), abs=1e-5
    )
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()


def _saved(state_dir, path: str) -> dict:
    """The adapter and AdamW state of a ``tinker://`` checkpoint, read from the state dir."""
    from rlpost.statefile import load_state

    (d,) = state_dir.glob("*/" + path.removeprefix("tinker://"))
    return load_state(d / "state.pt")


def test_an_importance_sampling_step_equals_the_trainers_update(service, state_dir, tiny_dir):
    """forward_backward("importance_sampling") + optim_step(AdamParams) through the SDK ==
    PolicyTrainer.update (what ``rlpost train``'s step calls) on the same completions laid out
    as ``rlpost train`` lays them (collate), with the matching rlpost config:
    algo.loss=ppo_clip (clip_low=1, clip_high=1e9, dual_clip=false: the ratio unclipped, so
    the loss is -sum r*A), train.loss_agg_mode=token-sum, train.optim as the AdamParams."""
    import peft

    import rlpost
    from rlpost.config import OptimConfig
    from rlpost.models.loading import load_policy
    from rlpost.params import PPOClipParams
    from rlpost.train.actor import ActorSettings, PolicyTrainer
    from rlpost.train.batch import collate
    from rlpost.types import Completion

    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    init = _saved(state_dir, tc.save_state("parity-init").result().path)["weights"]
    prompt = tc.get_tokenizer().encode("12+7=")
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    # Off-policy behaviour logprobs: ratios across [0.67, 1.5], past the clip range a wrong
    # mapping (ppo's) would apply.
    gen = torch.Generator().manual_seed(0)
    old = [(torch.tensor(s.logprobs) + 0.8 * torch.rand(len(s.logprobs), generator=gen) - 0.4)
           .tolist() for s in seqs]  # fmt: skip
    advantages, p = [1.0, -1.0, 0.5, -0.25], len(prompt) - 1
    data = [
        _datum([*prompt, *s.tokens], logprobs=[0.0] * p + lp,
               advantages=[0.0] * p + [a] * len(s.tokens))
        for s, lp, a in zip(seqs, old, advantages, strict=True)
    ]  # fmt: skip
    adam = types.AdamParams(
        learning_rate=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5
    )
    loss = tc.forward_backward(data, "importance_sampling").result().metrics["loss:sum"]
    tc.optim_step(adam).result()
    after = _saved(state_dir, tc.save_state("parity-after").result().path)["weights"]

    model, tokenizer = load_policy(tiny_dir, dtype="float32")
    lora = rlpost.LoRA(rank=4, train_unembed=True)  # the SDK's LoraConfig trains the head too
    cfg = peft.LoraConfig(r=4, lora_alpha=lora.alpha, target_modules=lora.targets(), bias="none")
    model = peft.get_peft_model(model.requires_grad_(False), cfg)
    peft.set_peft_model_state_dict(model, init)
    settings = ActorSettings(
        optim=OptimConfig(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), warmup_steps=0,
                          weight_decay=adam.weight_decay, grad_clip=adam.grad_clip_norm),
        loss_agg_mode="token-sum", mini_batch_size=64, micro_batch_size=64,
    )  # fmt: skip
    loss_cfg = PPOClipParams(clip_low=1.0, clip_high=1e9, dual_clip=False)
    trainer = PolicyTrainer(model, loss_cfg, settings)
    assert trainer.optimizer.defaults["eps"] == adam.eps
    done = [Completion(prompt, s.tokens, lp, "stop", 0, 0) for s, lp in zip(seqs, old, strict=True)]
    batch = collate(done, [0.0] * len(done), tokenizer.pad_token_id)
    adv = torch.tensor(advantages)[:, None] * batch.response_mask
    update = trainer.update(
        type(batch)(**{**batch.__dict__, "advantages": adv, "old_logprobs": batch.rollout_logprobs})
    )
    assert update.stats["loss"] == pytest.approx(loss, abs=1e-5)
    want = peft.get_peft_model_state_dict(model)
    assert want.keys() == after.keys()
    moved = max(float((after[k] - init[k]).abs().max()) for k in after)
    assert moved > 1e-4  # the step changed the adapter, so equal weights say something
    for k in after:
        torch.testing.assert_close(after[k], want[k], atol=1e-5, rtol=0, msg=k)


def test_rlpost_export_of_a_checkpoint_scores_as_its_sampler(service, state_dir, tmp_path, capsys):
    """``rlpost export tinker://...`` (of save_state and of save_weights_for_sampler): a merged
    HF directory whose logprobs under transformers are the sampler's, and a GGUF."""
    from transformers import AutoModelForCausalLM

    from rlpost.cli import main
    from rlpost.models.loading import load_causal_lm

    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tokens = _tokens(tc)
    datum = _datum(tokens, weights=[1.0] * (len(tokens) - 1))
    for _ in range(2):  # a trained adapter: the merge changes what the base scores
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    prompt = types.ModelInput.from_ints(tokens)
    base = service.create_sampling_client(base_model="tiny").result().compute_logprobs(prompt)
    base = np.array(base.result()[1:], dtype=np.float32)
    for saved in (tc.save_state("export").result().path,
                  tc.save_weights_for_sampler("export").result().path):  # fmt: skip
        out = tmp_path / saved.split("/")[-2]
        argv = ["export", saved, "--state-dir", str(state_dir), "--out", str(out)]
        assert main([*argv, "--gguf", "f32"]) == 0
        assert saved in capsys.readouterr().out and (out / "gguf" / "model-f32.gguf").is_file()
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
            gguf = load_causal_lm(out / "gguf")(torch.tensor([tokens])).logits[0, :-1]
        torch.testing.assert_close(gguf.log_softmax(-1), logits, atol=1e-4, rtol=0)
        got = logits.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
        sampler = service.create_sampling_client(model_path=saved).result()
        want = np.array(sampler.compute_logprobs(prompt).result()[1:], dtype=np.float32)
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert np.abs(want - base).max() > 1e-2  # the adapter is in the export
    capsys.readouterr()
    for source, why in [("tinker://nobody/weights/export", "no such checkpoint"),
                        ("tinker://../weights/export", "not a tinker://MODEL")]:  # fmt: skip
        argv = ["export", source, "--state-dir", str(state_dir), "--out", str(tmp_path / "bad")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err


def _post_fwdbwd(url, model_id, data, loss_fn="cross_entropy", key=KEY, config=None):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id=model_id,
        seq_id=1,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    return httpx.post(f"{url}/api/v1/forward_backward", content=body, headers=headers, timeout=60)


def _post(url, route, body, key=KEY):
    return httpx.post(f"{url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


def test_bad_input_is_a_4xx_naming_the_field(server, service):
    bad = service.create_lora_training_client(base_model="tiny", rank=2).result()
    mid, tokens = bad.model_id, _tokens(bad)
    n = len(tokens) - 1
    cases = [
        (_datum(tokens, target_tokens=tokens[1:-1]), "cross_entropy", "target_tokens"),
        (_datum(tokens, weights=[1.0] * (n + 2)), "cross_entropy", "weights"),
        (_datum(tokens), "no_such_loss", "loss_fn=no_such_loss"),
        (_datum(tokens, logprobs=[0.0] * n, advantages=[float("nan")] * n), "ppo", "advantages"),
        (_datum(tokens, advantages=[0.0] * n), "importance_sampling", "logprobs"),
        (_datum(list(range(200))), "cross_entropy", "context of 128"),
    ]
    for datum, loss_fn, field in cases:
        r = _post_fwdbwd(server, mid, [datum], loss_fn)
        assert r.status_code == 400 and field in r.json()["error"], (field, r.text)
    r = httpx.post(
        f"{server}/api/v1/forward_backward", content=b"\x07garbage", headers={"X-API-Key": KEY}
    )
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]
    step = {"model_id": mid, "adam_params": {"learning_rate": 1e-3}}
    r = _post(server, "optim_step", step)
    assert r.status_code == 400 and "no gradients accumulated" in r.json()["error"]

    saved = bad.save_state("mine").result().path
    other = tinker.ServiceClient(base_url=server, api_key=OTHER)
    session = other.holder.get_session_id()
    for path, status in [(saved, 404), (saved.replace("/mine", "/nothing"), 404), ("s3://x", 400)]:
        body = {"session_id": session, "sampling_session_seq_id": 9, "model_path": path}
        r = _post(server, "create_sampling_session", body, key=OTHER)
        assert r.status_code == status and "model_path" in r.json()["error"], r.text
    r = _post(server, "get_info", {"model_id": mid}, key=OTHER)
    assert r.status_code == 404 and "model_id" in r.json()["error"]
    with pytest.raises(tinker.NotFoundError, match="model_path"):
        other.create_sampling_client(model_path=saved).result()

    # The service still serves this key and the others.
    ok = _post_fwdbwd(server, mid, [_datum(tokens)])
    assert ok.status_code == 200 and "request_id" in ok.json()
    other.close("success").result()
    r = _post(server, "get_info", {"model_id": mid})
    assert r.status_code == 200


def test_a_request_after_the_session_ended_is_refused(server):
    client = tinker.ServiceClient(base_url=server, api_key=KEY)
    tc = client.create_lora_training_client(base_model="tiny", rank=2).result()
    client.close("success").result()
    for r in (_post(server, "get_info", {"model_id": tc.model_id}),
              _post_fwdbwd(server, tc.model_id, [_datum(_tokens(tc))])):  # fmt: skip
        assert r.status_code == 400 and "session has ended" in r.json()["error"], r.text


def test_unserved_routes_answer_clearly(server):
    r = httpx.get(f"{server}/api/v1/billing/usage", headers={"X-API-Key": KEY})
    assert r.status_code == 404 and "not served by rlpost tinker" in r.json()["error"]
    assert _post(server, "telemetry", {"events": []}).json() == {"status": "accepted"}


def _step(tc, datum) -> float:
    out = tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return out.metrics["loss:sum"]


def test_save_state_survives_kill_9_and_resumes_the_optimizer(tiny_dir, tmp_path):
    proc, url = start(tiny_dir, tmp_path)
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    datum = _datum(_tokens(tc), weights=[1.0] * (len(_tokens(tc)) - 1))
    _step(tc, datum)
    path = tc.save_state("resume").result().path
    _step(tc, datum)
    never_stopped = _step(tc, datum)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with contextlib.suppress(Exception):  # its heartbeats stop; the server is gone
        client.close("interrupted").result(timeout=30)

    proc, url = start(tiny_dir, tmp_path)
    try:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        _step(resumed, datum)
        assert _step(resumed, datum) == pytest.approx(never_stopped, abs=1e-5)
        weights_only = client.create_training_client_from_state(path).result()
        assert weights_only.get_info().lora_rank == 4
        resumed.load_state_with_optimizer(path).result()
        client.close("success").result()
    finally:
        stop(proc)
