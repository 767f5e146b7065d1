"""Loading a checkpoint directory: what a user can get wrong ends in one ModelLoadError line."""

import shutil

import pytest

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
