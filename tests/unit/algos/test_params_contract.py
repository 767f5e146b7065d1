"""Each registered loss and estimator takes exactly its typed parameter class (CPU).

The class in ``rlpost.params`` holds the defaults the config passes; the function's
signature holds the defaults a direct caller gets. They must be the same names with the
same defaults, and every other keyword must be one the kind's caller supplies.
"""

from __future__ import annotations

import inspect

import pytest

from rlpost.algos import ADVANTAGES, POLICY_LOSSES
from rlpost.algos import advantages as advantages_module
from rlpost.algos import policy_losses as losses_module
from rlpost.params import AdvantagesConfig, LossesConfig, params_of

KINDS = [
    (POLICY_LOSSES, LossesConfig, losses_module.CALLER_INPUTS),
    (ADVANTAGES, AdvantagesConfig, advantages_module.CALLER_INPUTS),
]
ENTRIES = [(reg, section, inputs, name) for reg, section, inputs in KINDS for name in reg.names()]


def _keywords(fn) -> dict:
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    }


@pytest.mark.parametrize(
    ("registry", "section", "inputs", "name"), ENTRIES, ids=[e[3] for e in ENTRIES]
)
def test_keyword_parameters_equal_the_class_fields(registry, section, inputs, name):
    keywords = _keywords(registry.get(name))
    params = {k: v for k, v in keywords.items() if k not in inputs}
    assert params_of(section(), name) == params, name  # same names, same defaults
    field = section.model_fields.get(name)
    if field is not None:
        assert not set(field.annotation.model_fields) & inputs  # no parameter shadows an input


@pytest.mark.parametrize(("registry", "section", "inputs"), KINDS)
def test_every_section_names_a_registered_function_and_has_help(registry, section, inputs):
    assert set(section.model_fields) <= set(registry.names())
    for name, field in section.model_fields.items():
        assert field.description, name
        for param, sub in field.annotation.model_fields.items():
            assert sub.description, f"{name}.{param}"
