"""Weight layouts: the builder picks one from the config, each exports the engines' names
and reads back what it wrote, and the trainer and its worker ask none of them which it is
(CPU, the tiny model; the sharded layout runs in tests/integration/test_data_parallel.py)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from rlpost.config import load_config
from rlpost.pipeline import build
from rlpost.train import actor, worker
from rlpost.train.layout import LoRALayout, PlainLayout
from tests.conftest import small_overrides


def _worker(tmp_path, **over):
    cfg = load_config(None, small_overrides(tmp_path, **over))
    model, tokenizer = build.build_policy(cfg)
    return cfg, model, build.build_trainer_worker(cfg, model, tokenizer)


def test_plain_layout_keeps_a_frozen_reference_and_exports_the_parameters(tmp_path):
    _, model, w = _worker(tmp_path)
    assert isinstance(w.layout, PlainLayout) and w.layout is w.trainer.layout
    assert w.layout.has_reference and w.layout.ref is not model
    names = [n for n, _ in model.named_parameters()]
    assert [n for n, _ in w.export_weights().tensors] == names
    no_kl = _worker(tmp_path, **{"algo.kl.beta": 0.0})[2]
    assert not no_kl.describe()["has_reference"] and no_kl.logprobs(_batch(no_kl), "ref") is None


def _batch(w):
    from rlpost.train.batch import collate
    from rlpost.types import Completion

    cs = [Completion([3, 4, 5], [6, 7], [-1.0, -1.0], "stop", 0, i) for i in range(2)]
    return collate(cs, [1.0, 0.0], w.tokenizer.pad_token_id)


def test_lora_layout_scores_the_base_and_exports_merged_base_names(tmp_path):
    pytest.importorskip("peft")
    w = _worker(tmp_path, **{"model.lora.rank": 4})[2]
    assert isinstance(w.layout, LoRALayout) and w.describe()["has_reference"]
    base = w.trainer.model.get_base_model()
    base_names = [n for n, _ in base.named_parameters()]
    exported = w.export_weights().tensors
    assert [n for n, _ in exported] == [
        n.replace(".base_layer.", ".") for n in base_names if "lora_" not in n
    ]
    batch = _batch(w)
    # fresh adapters (B = 0): the reference (adapters off) is the policy exactly
    torch.testing.assert_close(w.logprobs(batch, "ref"), w.logprobs(batch, "old"))


def test_a_plain_checkpoint_does_not_resume_a_lora_run_silently(tmp_path):
    pytest.importorskip("peft")
    plain = _worker(tmp_path / "a")[2]
    plain.save(tmp_path / "plain")
    lora = _worker(tmp_path / "b", **{"model.lora.rank": 4})[2]
    with pytest.raises(ValueError, match="no adapter/ directory") as err:
        lora.restore(tmp_path / "plain", version=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("module", [actor, worker])
def test_trainer_and_worker_ask_no_layout_flag(module):
    """No attribute named for a layout is read in the trainer or its worker: the layout
    object answers instead."""
    tree = ast.parse(inspect.getsource(module))
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    assert not read & {"lora", "dp", "ref_model", "reference"}
    assert "base_lrs" not in inspect.getsource(worker)
