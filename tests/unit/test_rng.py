"""Seeds derived from the run's seed: one table, distinct streams (CPU)."""

from __future__ import annotations

import itertools

import pytest

from rlpost.rng import STREAMS, derive


def test_each_purpose_is_its_linear_form_of_the_seed_and_indices():
    assert derive(3, "eval") == 3 + 10_007
    assert derive(3, "epoch_order", 2) == 3 * 100_003 + 2
    assert derive(3, "worker", 1, 2) == 3 + 7_919 + 2 * 104_729


def test_streams_of_one_seed_differ():
    for seed in range(8):
        # the trainer's, the critic's and the evaluation's generators are never the same
        assert len({derive(seed, p) for p in ("actor_shuffle", "critic_shuffle", "eval")}) == 3
        for purpose, (_, weights, _) in STREAMS.items():  # distinct indices, distinct seeds
            grid = list(itertools.product(range(6), repeat=len(weights)))
            assert len({derive(seed, purpose, *i) for i in grid}) == len(grid), purpose
    # a worker and its restart, or two workers, never draw the same stream
    assert derive(0, "worker", 1, 0) != derive(0, "worker", 0, 1)


def test_a_wrong_number_of_indices_or_an_unknown_purpose_is_refused():
    with pytest.raises(ValueError, match="takes 1 indices"):
        derive(0, "epoch_order")
    with pytest.raises(KeyError):
        derive(0, "nope")
