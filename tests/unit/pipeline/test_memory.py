"""The memory preflight: its terms follow the configured step, and a step that cannot fit
is refused in one line that names the key to change."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from rlpost.config import ConfigError, load_config
from rlpost.pipeline.memory import check_memory, estimate, model_shape, summary_fields


def _real_shape_dir(tmp_path, **dims):
    """A config.json of a 151,936-token Llama (no weights: the estimate reads none)."""
    shape = dict(
        vocab_size=151_936,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    LlamaConfig(**(shape | dims), tie_word_embeddings=True).save_pretrained(tmp_path)
    return str(tmp_path)


def test_terms_follow_the_config(tmp_path):
    path = _real_shape_dir(tmp_path)
    base = ["rollout.max_tokens=256", "train.micro_batch_size=8", "algo.kl.beta=0"]
    cfg = load_config(None, [f"model.path={path}", *base])
    shape = model_shape(cfg)
    assert shape["vocab"] == 151_936 and 38e6 < shape["params"] < 45e6
    chunked = estimate(cfg, shape)
    full = estimate(
        load_config(None, [f"model.path={path}", *base, "train.logits_chunk_tokens=-1"]), shape
    )
    assert full.logits > 10 * chunked.logits  # [8, 256, V] x3 against one 64 MiB chunk x4
    assert chunked.reference == 0
    with_ref = estimate(load_config(None, [f"model.path={path}", "algo.kl.beta=0.1"]), shape)
    assert with_ref.reference == pytest.approx(chunked.weights)
    assert chunked.optimizer == pytest.approx(2 * chunked.gradients)
    default = check_memory(load_config(None, []))
    assert default is not None and default.total < chunked.total
    # the full-vocabulary distillation loss holds [8, 256, V] of the student's and the
    # teacher's, past the chunked head: twice the unchunked path's term
    gkd = estimate(load_config(None, [f"model.path={path}", *base, "algo.loss=gkd"]), shape)
    assert gkd.logits == pytest.approx(2 * full.logits)


def test_a_step_that_cannot_fit_is_refused_naming_the_key(tmp_path):
    path = _real_shape_dir(tmp_path)
    full = ["train.logits_chunk_tokens=-1", "rollout.max_tokens=1024", "train.micro_batch_size=8"]
    cfg = load_config(None, [f"model.path={path}", *full])
    est = estimate(cfg, model_shape(cfg))
    with pytest.raises(ConfigError, match=r"largest: logits .*train.logits_chunk_tokens=0") as e:
        check_memory(cfg, total_mib=est.total - 1)
    assert "\n" not in str(e.value)
    assert check_memory(cfg, total_mib=est.total + 1).total == pytest.approx(est.total)


def test_summary_fields_hold_the_measured_peak_and_the_estimate():
    est = check_memory(load_config(None, []))
    out = json.loads(json.dumps(summary_fields(est)))
    assert out["peak_rss_mib"] > 50
    assert out["memory_estimate_mib"]["total"] == round(est.total)


def test_one_thread_at_a_real_shape_is_noted(tmp_path, capsys, monkeypatch):
    from rlpost.pipeline.memory import note_idle_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    real = {"params": 40_000_000, "vocab": 151_936}
    toy = {"params": 100_000, "vocab": 83}
    assert note_idle_cores(load_config(None, ["run.threads=1"]), real)
    line = capsys.readouterr().out.strip()
    assert "run.threads=1 leaves 3 of 4 cores idle" in line and "\n" not in line
    assert not note_idle_cores(load_config(None, ["run.threads=1"]), toy)
    assert not note_idle_cores(load_config(None, ["run.threads=0"]), real)
    capsys.readouterr()
    assert note_idle_cores(load_config(None, ["run.threads=2"]), real)
    assert "run.threads=2 leaves 2 of 4 cores idle" in capsys.readouterr().out
    assert not note_idle_cores(load_config(None, ["run.threads=4"]), real)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0})
    assert not note_idle_cores(load_config(None, ["run.threads=1"]), real)


def test_real_checkpoint_recipe_resolves_bf16_from_the_cpu():
    from rlpost.config import RECIPES_DIR
    from rlpost.observe.mfu import cpu_bf16_native
    from rlpost.resolved import resolve

    cfg = load_config(
        RECIPES_DIR / "grpo_file.yaml", ["data.task.train_path=t.jsonl", "rollout.max_tokens=16"]
    )
    assert cfg.model.dtype == "auto"
    assert resolve(cfg).bf16 == cpu_bf16_native()
    assert not resolve(load_config(None, ["model.dtype=float32"])).bf16
    assert resolve(load_config(None, ["model.dtype=bfloat16"])).bf16


@pytest.mark.parametrize("engine", ["hf", "hf_continuous"])
def test_an_in_process_engine_counts_its_copy_and_kv_cache(tmp_path, engine):
    """Both in-process engines hold a serving copy and a KV cache; engines that load their
    own weights (vllm, remote) hold neither in this process."""
    path = _real_shape_dir(tmp_path)
    base = [f"model.path={path}", "pipeline.mode=one_step_off"]  # no storage sharing
    here = load_config(None, [*base, f"rollout.engine={engine}"])
    remote = load_config(
        None, [*base, "rollout.engine=remote", 'rollout.engine.servers=["http://x:1"]']
    )
    shape = model_shape(here)
    assert estimate(here, shape).engine > 0 and estimate(here, shape).kv_cache > 0
    assert estimate(remote, shape).engine == 0 and estimate(remote, shape).kv_cache == 0


def _saved_bytes_per_layer(config: LlamaConfig, rows: int, seq: int) -> float:
    """Bytes autograd keeps for the backward of one decoder layer: the saved tensors of a
    two-layer model less those of a one-layer model (embeddings and final norm cancel),
    parameters left out (the weights term counts them)."""
    import torch
    from transformers import LlamaForCausalLM

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.model.layers = model.model.layers[:layers]
        ids = torch.randint(0, config.vocab_size, (rows, seq))
        mask = torch.ones(rows, seq, dtype=torch.long)
        mask[: rows // 2, : seq // 8] = 0  # left padding, as the trainer's batches have
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def keep(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model.model(input_ids=ids, attention_mask=mask)
        del out
        return sum(storages.values())

    return saved(2) - saved(1)


@pytest.mark.parametrize(
    "dims",
    [
        dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4),
        # SmolLM2-135M's layer: grouped KV heads, a 2.67x MLP
        dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3),
    ],
)
def test_activation_term_matches_what_a_llama_layer_saves(dims):
    """The per-layer activation term against the bytes a transformers Llama layer (fp32,
    sdpa) actually keeps for its backward, at a real shape and at SmolLM2's."""
    from rlpost.pipeline.memory import layer_activations

    config = LlamaConfig(vocab_size=512, num_hidden_layers=2, **dims)
    rows, seq = 4, 256
    measured = _saved_bytes_per_layer(config, rows, seq)
    h, heads = dims["hidden_size"], dims["num_attention_heads"]
    shape = {"hidden": h, "heads": heads, "intermediate": dims["intermediate_size"]}
    assert layer_activations(shape, rows, seq, 4, eager=False) == pytest.approx(measured, rel=0.1)
    # eager attention adds the [rows, heads, seq, seq] scores on top
    eager = layer_activations(shape, rows, seq, 4, eager=True)
    assert eager - layer_activations(shape, rows, seq, 4, eager=False) >= rows * heads * seq**2 * 4


def test_under_bf16_autocast_a_layer_saves_most_of_what_float32_saves():
    """Why the activation term is float32's size under bf16 too: autocast keeps the residual
    stream and norms in float32 and saves each matmul's input in both dtypes."""
    import torch

    from rlpost.pipeline.memory import layer_activations

    dims = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9)
    config = LlamaConfig(vocab_size=512, num_hidden_layers=2, num_key_value_heads=3, **dims)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = _saved_bytes_per_layer(config, 4, 256)
    shape = {"hidden": 576, "heads": 9, "intermediate": 1536}
    assert 0.6 < measured / layer_activations(shape, 4, 256, 4, eager=False) < 1.0


def test_checkpointing_keeps_layer_inputs_and_one_recomputed_layer(tmp_path):
    from rlpost.pipeline.memory import layer_activations

    path = _real_shape_dir(tmp_path)
    base = [f"model.path={path}", "model.dtype=float32", "rollout.max_tokens=256"]
    base += ["train.micro_batch_size=8"]
    cfg = load_config(None, base)
    shape = model_shape(cfg)
    plain = estimate(cfg, shape).activations
    ckpt = estimate(load_config(None, [*base, "model.gradient_checkpointing=true"]), shape)
    seq = 256 + 256  # the assumed prompt and the responses
    layer = layer_activations(shape, 8, seq, 4, eager=False) / 2**20
    assert plain == pytest.approx(shape["layers"] * layer)
    inputs = shape["layers"] * 8 * seq * shape["hidden"] * 4 / 2**20
    assert ckpt.activations == pytest.approx(inputs + layer)


def test_a_trainer_layout_splits_one_ranks_terms_and_the_machine_holds_every_rank(tmp_path):
    """At TP=3 a rank holds 1/3 of the decoder matrices and of the (tied) embedding, and the
    norms whole (SmolLM2's share measured on the ranks' DTensor shards by
    bench/bench_parallel.py: 684.5 MiB against 2,052.5 in one process), and 1/3 of a chunk's
    logits; three processes on this machine need three ranks' memory."""
    from rlpost.pipeline.memory import machine_need

    smollm2 = dict(  # SmolLM2-135M's shape: 30 layers, 9 heads, 3 KV heads, tied head
        vocab_size=49_152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    )  # fmt: skip
    base = [f"model.path={_real_shape_dir(tmp_path, **smollm2)}", "model.dtype=float32"]
    one = load_config(None, base)
    tp3 = load_config(None, [*base, "cluster.trainer_workers=3", "cluster.tensor_parallel=3"])
    shape = model_shape(one)
    assert shape["split"] == 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    e1, e3 = estimate(one, shape), estimate(tp3, shape)
    share = e3.weights + e3.gradients + e3.optimizer
    assert e1.weights + e1.gradients + e1.optimizer == pytest.approx(2052.5, abs=0.1)
    assert shape["vocab_split"] == 49_152 * 576  # tied: the embedding alone
    assert share == pytest.approx(684.5, abs=0.1)
    assert e3.logits == pytest.approx(e1.logits / 3)  # a rank's rows of each chunk
    assert e1.activations / 3 < e3.activations < e1.activations  # the norms' stay whole
    need = machine_need(tp3, e3)
    assert need == pytest.approx(e3.total + 2 * (e3.total - e3.engine - e3.kv_cache))
    with pytest.raises(ConfigError, match=r"the step's 3 trainer ranks need ~[\d,]+ MiB \(~") as e:
        check_memory(tp3, total_mib=need - 1)
    assert "\n" not in str(e.value)
    assert check_memory(tp3, total_mib=need + 1) is not None
    # FSDP2 over two data-parallel groups halves a rank's share again
    mesh = load_config(None, [*base, "cluster.trainer_workers=6", "cluster.tensor_parallel=3"])
    assert estimate(mesh, shape).weights == pytest.approx(e3.weights / 2)
