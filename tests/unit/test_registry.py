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


def test_a_user_spec_is_imported_once_and_carries_its_declared_traits(tmp_path, monkeypatch):
    from rlpost.registry import Registry

    (tmp_path / "mine.py").write_text(
        "from rlpost.registry import part\n\n"
        "@part(needs_reference=True)\ndef fn(x):\n    return x\n\n"
        "def plain(x):\n    return x\n"
    )
    monkeypatch.chdir(tmp_path)
    reg = Registry("thing")
    assert reg.get("mine.py:fn")(3) == 3 and reg.get("mine.py:fn") is reg.get("mine.py:fn")
    assert reg.trait("mine.py:fn", "needs_reference") is True
    assert reg.trait("mine.py:plain", "needs_reference") is False  # undeclared: safe default
    assert reg.names() == []  # user code is not offered as a registered name
