"""HackingMonitor: flags reward-without-accuracy and length ballooning over a window."""

import math

import pytest

from rlpost.rewards.monitor import LENGTH_BALLOON, REWARD_UP_ACCURACY_FLAT, HackingMonitor


def feed(monitor, rows):
    return [monitor.update(*row) for row in rows]


def test_no_flags_before_window_is_full():
    monitor = HackingMonitor(window=4, reward_rise=0.1)
    flags = feed(monitor, [(0.0, 0.5, 10), (1.0, 0.5, 100), (2.0, 0.5, 1000)])
    assert flags == [[], [], []]


def test_reward_up_with_flat_accuracy_is_flagged():
    monitor = HackingMonitor(window=4, reward_rise=0.2, accuracy_band=0.02)
    flags = feed(monitor, [(0.1, 0.50, 10), (0.1, 0.51, 10), (0.5, 0.50, 10), (0.5, 0.51, 10)])
    assert flags[-1] == [REWARD_UP_ACCURACY_FLAT]
    assert monitor.counts[REWARD_UP_ACCURACY_FLAT] == 1


def test_reward_up_with_accuracy_falling_is_flagged_too():
    monitor = HackingMonitor(window=2, reward_rise=0.2)
    assert feed(monitor, [(0.1, 0.6, 10), (0.9, 0.3, 10)])[-1] == [REWARD_UP_ACCURACY_FLAT]


def test_honest_progress_is_not_flagged():
    monitor = HackingMonitor(window=4, reward_rise=0.2, accuracy_band=0.02)
    rows = [(0.1, 0.1, 10), (0.2, 0.2, 11), (0.5, 0.5, 12), (0.6, 0.6, 12)]
    assert feed(monitor, rows)[-1] == []


def test_small_reward_rise_and_missing_accuracy_not_flagged():
    monitor = HackingMonitor(window=2, reward_rise=0.2)
    assert feed(monitor, [(0.1, 0.5, 10), (0.2, 0.5, 10)])[-1] == []
    no_acc = HackingMonitor(window=2, reward_rise=0.2)
    assert feed(no_acc, [(0.1, None, 10), (0.9, None, 10)])[-1] == []


def test_length_balloon():
    monitor = HackingMonitor(window=4, length_factor=1.5)
    rows = [(0.1, 0.5, 100), (0.1, 0.5, 100), (0.1, 0.5, 149), (0.1, 0.5, 151)]
    assert feed(monitor, rows)[-1] == []  # 150 / 100 is not more than 1.5
    assert monitor.update(0.1, 0.5, 300) == [LENGTH_BALLOON]  # window now 100,149,151,300


def test_both_flags_and_sliding_window_forgets():
    monitor = HackingMonitor(window=2, reward_rise=0.2, length_factor=1.5)
    assert feed(monitor, [(0.0, 0.5, 10), (1.0, 0.5, 20)])[-1] == [
        REWARD_UP_ACCURACY_FLAT,
        LENGTH_BALLOON,
    ]
    assert monitor.update(1.0, 0.5, 20) == []  # the old step left the window


def test_non_finite_inputs_ignored_and_bad_settings():
    monitor = HackingMonitor(window=2)
    assert feed(monitor, [(math.nan, 0.5, math.inf), (1.0, 0.5, 10)])[-1] == []
    with pytest.raises(ValueError, match="window"):
        HackingMonitor(window=1)
    with pytest.raises(ValueError, match="length_factor"):
        HackingMonitor(length_factor=1.0)
