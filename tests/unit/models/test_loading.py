"""Loading a checkpoint directory: what a user can get wrong ends in one ModelLoadError line."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlpost.models.loading import ModelLoadError, load_causal_lm


@pytest.mark.parametrize("cut", [0, 7, 200])
def test_a_torn_weights_file_is_one_line(tiny_dir, tmp_path, cut):
    torn = tmp_path / "model"
    shutil.copytree(tiny_dir, torn)
    weights = torn / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:cut])
    with pytest.raises(ModelLoadError) as caught:
        load_causal_lm(torn)
    assert "\n" not in str(caught.value) and str(torn) in str(caught.value)


def test_a_missing_directory_is_one_line(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_causal_lm(tmp_path / "nowhere")


def _without(tiny_dir, tmp_path, drop=(), add=None, untie=False):
    """A copy of the tiny checkpoint without the weights ``drop``, with ``add``; ``untie``:
    its output head a weight of its own first."""
    model = load_causal_lm(tiny_dir)
    if untie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    out = tmp_path / "model"
    model.save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    for name in drop:
        weights.pop(name)
    weights.update(add or {})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    ("drop", "add", "says"),
    [
        (["model.layers.1.mlp.up_proj.weight"], None, "1 weight (model.layers.1.mlp.up_proj"),
        ([], {"value_head.weight": torch.zeros(2)}, "1 weight (value_head.weight) the model"),
        (
            [f"model.layers.{i}.self_attn.{x}_proj.weight" for i in (0, 1) for x in "qkv"],
            None,
            "6 weights (model.layers.0.self_attn.k_proj.weight, ",
        ),
    ],
    ids=["missing", "unexpected", "many missing"],
)
def test_a_checkpoint_missing_a_weight_or_holding_another_is_one_line(
    tiny_dir, tmp_path, drop, add, says
):
    """transformers would initialise a missing weight at random (and drop an unexpected one)
    and, its log quieted, print nothing: refused, naming the weights."""
    path = _without(tiny_dir, tmp_path, drop, add)
    with pytest.raises(ModelLoadError) as caught:
        load_causal_lm(path)
    line = str(caught.value)
    assert "\n" not in line and says in line and f"model.path={str(path)!r}" in line, line


def test_a_tied_output_head_is_not_missing_an_untied_one_is(tiny_dir, tmp_path):
    assert "lm_head.weight" not in load_file(tiny_dir / "model.safetensors")  # tied: not saved
    assert load_causal_lm(tiny_dir).config.tie_word_embeddings
    untied = _without(tiny_dir, tmp_path, ["lm_head.weight"], untie=True)
    with pytest.raises(ModelLoadError, match=r"1 weight \(lm_head.weight\) missing"):
        load_causal_lm(untied)
