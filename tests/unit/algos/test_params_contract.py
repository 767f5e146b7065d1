"""Each registered loss, estimator and correction takes exactly its variant's parameters (CPU).

A choice in the config (``algo.loss``, ``algo.advantage``, ``algo.rollout_correction``) is
a union of one variant class per registered name. A policy loss takes its variant itself
(``fn(inputs, params)``), so the variant's defaults are the only ones. An estimator takes
the variant's fields as keywords: the function's defaults must be the variant's, and every
other keyword one the estimator's caller supplies.
"""

from __future__ import annotations

import inspect
import typing

import pytest

from rlpost.algos import ADVANTAGES, POLICY_LOSSES
from rlpost.algos import advantages as advantages_module
from rlpost.algos.correction import CORRECTIONS
from rlpost.algos.policy_losses import LossInputs
from rlpost.params import AdvantageChoice, CorrectionChoice, LossChoice, variants

KINDS = [
    (POLICY_LOSSES, LossChoice, frozenset()),
    (ADVANTAGES, AdvantageChoice, advantages_module.CALLER_INPUTS),
]
ENTRIES = [(ADVANTAGES, AdvantageChoice, advantages_module.CALLER_INPUTS, n) for n in ADVANTAGES]


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
    assert sorted(variants(union)) == sorted(registry.names())
    for name, cls in variants(union).items():
        assert cls().name == name
        for param, sub in cls.model_fields.items():
            assert param == "name" or sub.description, f"{name}.{param}"


def test_every_correction_is_a_variant():
    assert sorted(variants(CorrectionChoice)) == sorted(["none", *CORRECTIONS.names()])


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_a_loss_takes_its_inputs_and_its_variant(name):
    fn = POLICY_LOSSES.get(name)
    hints = typing.get_type_hints(fn)
    first, second = list(inspect.signature(fn).parameters)
    assert hints[first] is LossInputs
    assert issubclass(
        variants(LossChoice)[name], hints[second]
    )  # dapo is ppo_clip's, gpg reinforce's
