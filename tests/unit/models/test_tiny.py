import pytest
import torch

from rlpost.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from rlpost.models.tiny import build_char_tokenizer


@pytest.mark.parametrize("text", ["12+7=", " spaces  and\nnewlines\n", "a-b*c = {x}!"])
def test_char_tokenizer_round_trips_exactly(text):
    tok = build_char_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_saved_checkpoint_reloads_with_auto_classes(tiny_dir):
    model = load_causal_lm(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.decode(tok(" 1 + 2 =\n")["input_ids"], skip_special_tokens=True) == " 1 + 2 =\n"
    ids = torch.tensor([tok("3+4=")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, 4, len(tok))


def test_missing_or_broken_model_dir_is_one_line(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_causal_lm(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as err:
        load_causal_lm(broken)
    assert "\n" not in str(err.value)
