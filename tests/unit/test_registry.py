"""``import_object``: the one way a config names user code (rewards, environments, agent
harnesses, verifiers), each failure one line naming what is missing."""

import pytest

from rlpost.registry import import_object


def test_a_module_or_a_file_names_an_object(tmp_path, monkeypatch):
    assert import_object("json:dumps")([1]) == "[1]"
    user = tmp_path / "user_code.py"
    user.write_text("def answer():\n    return 42\n")
    assert import_object(f"{user}:answer")() == 42
    monkeypatch.chdir(tmp_path)  # a relative path: from the working directory
    assert import_object("user_code.py:answer")() == 42
    # or from the checkout rlpost lives in
    assert callable(import_object("rlpost/envs/examples/calc_agent.py:run"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "'no_colon' must be package.module:name or file.py:name"),
        ("json:", "'json:' must be package.module:name or file.py:name"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("json:no_such_name", "json has no 'no_such_name'"),
        ("nowhere/x.py:f", "no file 'nowhere/x.py'"),
    ],
)
def test_what_is_missing_is_one_line(spec, message):
    with pytest.raises(ValueError) as caught:
        import_object(spec)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_file_that_raises_on_import_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"bad.py does not load \(RuntimeError: boom\)"):
        import_object(f"{bad}:f")
