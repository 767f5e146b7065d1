"""A step's metrics have one owner per key (CPU): merging refuses a key written twice."""

from __future__ import annotations

import pytest

from rlpost.observe.metrics import DuplicateMetric, merge_metrics


def test_distinct_keys_merge_in_order():
    merged = merge_metrics({"loss": 1.0}, {}, {"kl": 0.5, "beta": 0.1})
    assert merged == {"loss": 1.0, "kl": 0.5, "beta": 0.1}
    assert list(merged) == ["loss", "kl", "beta"]


def test_a_key_from_two_sources_is_refused_naming_it():
    with pytest.raises(DuplicateMetric, match="'sample_drop_ratio'"):
        merge_metrics({"sample_drop_ratio": 0.0}, {"kl": 1.0}, {"sample_drop_ratio": 0.1})
