"""Each registered loss, estimator and correction takes exactly its variant's parameters (CPU).

A choice in the config (``algo.loss``, ``algo.advantage``, ``algo.rollout_correction``) is
a union of one variant class per registered name. The variant holds the defaults the
config passes; the function's signature holds the defaults a direct caller gets. They
must be the same names with the same defaults, and every other keyword must be one the
kind's caller supplies.
"""

from __future__ import annotations

import inspect
from typing import get_args

import pytest

from rlpost.algos import ADVANTAGES, POLICY_LOSSES
from rlpost.algos import advantages as advantages_module
from rlpost.algos import policy_losses as losses_module
from rlpost.algos.correction import CORRECTIONS
from rlpost.params import AdvantageChoice, CorrectionChoice, LossChoice, variant_names


def variants(union) -> dict:
    return {a.__metadata__[0].tag: a.__origin__ for a in get_args(get_args(union)[0])}


KINDS = [
    (POLICY_LOSSES, LossChoice, losses_module.CALLER_INPUTS),
    (ADVANTAGES, AdvantageChoice, advantages_module.CALLER_INPUTS),
]
ENTRIES = [(reg, union, inputs, name) for reg, union, inputs in KINDS for name in reg.names()]


def _keywords(fn) -> dict:
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    }


@pytest.mark.parametrize(
    ("registry", "union", "inputs", "name"), ENTRIES, ids=[e[3] for e in ENTRIES]
)
def test_keyword_parameters_equal_the_variant_fields(registry, union, inputs, name):
    keywords = _keywords(registry.get(name))
    params = {k: v for k, v in keywords.items() if k not in inputs}
    assert variants(union)[name]().params() == params, name  # same names, same defaults
    assert not set(variants(union)[name].model_fields) & inputs  # no parameter shadows an input


@pytest.mark.parametrize(("registry", "union", "inputs"), KINDS)
def test_every_registered_name_is_a_variant_with_help(registry, union, inputs):
    assert sorted(variant_names(union)) == sorted(registry.names())
    for name, cls in variants(union).items():
        assert cls().name == name
        for param, sub in cls.model_fields.items():
            assert param == "name" or sub.description, f"{name}.{param}"


def test_every_correction_is_a_variant():
    assert sorted(variant_names(CorrectionChoice)) == sorted(["none", *CORRECTIONS.names()])
