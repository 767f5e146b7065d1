"""A run starts from a .gguf file and `rlpost export` writes its policy back out (CPU,
tiny model): the run's checkpoints are ordinary HF directories, and the exported GGUF
reads back with the checkpoint's logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from rlpost.cli import main
from rlpost.config import load_config
from rlpost.models.export import export_model
from rlpost.models.loading import load_causal_lm, load_policy
from rlpost.models.tiny import build_char_tokenizer, build_tiny_model, save_tiny_checkpoint
from rlpost.pipeline.rules import check
from tests.conftest import small_overrides


@pytest.fixture()
def tiny_gguf(tmp_path):
    # seed 7: weights the built-in tiny model (seed 0) does not have
    src = save_tiny_checkpoint(tmp_path / "seed7", seed=7, hidden_size=32, intermediate_size=64)
    model, tok = load_policy(src)
    return export_model(model, tok, tmp_path / "start", gguf_type="f32", overwrite=False)["gguf"]


def distance(a, b) -> float:
    return sum((x - y).norm().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_train_from_a_gguf_then_export_the_run(tiny_gguf, tmp_path, capsys):
    over = small_overrides(tmp_path / "runs", **{"model.path": tiny_gguf, "train.steps": 2})
    assert main(["train", *over]) == 0
    run_dir = tmp_path / "runs" / "t"
    policy = run_dir / "checkpoints" / "step_2" / "model"
    assert (policy / "config.json").is_file() and (policy / "tokenizer.json").is_file()
    assert "quantization_config" not in (policy / "config.json").read_text()
    start, trained = load_causal_lm(tiny_gguf), load_causal_lm(policy)
    builtin = build_tiny_model(build_char_tokenizer(), seed=0, hidden_size=32, intermediate_size=64)
    moved = distance(start, trained)
    assert 0 < moved < distance(builtin, trained) / 10  # trained from the GGUF's weights

    assert main(["export", str(run_dir), "--out", str(tmp_path / "out"), "--gguf", "f32"]) == 0
    assert str(policy) in capsys.readouterr().out
    back = load_causal_lm(tmp_path / "out" / "gguf")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, trained(ids).logits, atol=1e-5)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_vllm_on_a_gguf_is_refused_before_any_work(tiny_gguf, tmp_path):
    from rlpost.config import ConfigError

    over = small_overrides(tmp_path, **{"model.path": tiny_gguf, "rollout.engine": "vllm"})
    with pytest.raises(ConfigError, match=r"rlpost export .* --out DIR") as err:
        check(load_config(None, over), "train")
    assert "\n" not in str(err.value)


def test_a_gguf_teacher_is_accepted_and_loads(tiny_gguf, tmp_path):
    from rlpost.models.vocab import vocab_digest
    from rlpost.train.teacher import LocalTeacher

    extra = {"model.teacher.path": tiny_gguf, "algo.advantage": "on_policy_distill"}
    check(load_config(None, small_overrides(tmp_path, **extra)), "train")
    student = vocab_digest(load_policy(tiny_gguf)[1])
    teacher = LocalTeacher(str(tiny_gguf), student)
    assert teacher.model.config.model_type == "llama"
