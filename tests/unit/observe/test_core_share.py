"""cluster.share_cores: the trainer takes the rollout process's cores while it runs no call,
and hands them back when it starts one; each thread's count is its own."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from rlpost.cluster.process import _core_share
from rlpost.config import load_config
from rlpost.observe import threads
from rlpost.observe.threads import CoreShare, pace, share_cores


def test_the_count_follows_the_rollout_process_state():
    busy, calls = mp.get_context("spawn").RawValue("i", 0), []
    share = CoreShare(busy, 1, 1, calls.append)
    assert share.pace() == 2 and calls == [2]  # idle: its core is lent
    assert share.pace() == 2 and calls == [2]  # unchanged: torch is not called again
    busy.value = 1
    assert share.pace() == 1 and calls == [2, 1]  # it generates: handed back
    busy.value = 2
    assert share.pace() == 1 and calls == [2, 1]
    busy.value = 0
    assert share.pace() == 2 and calls == [2, 1, 2] and share.switches == 3
    with pytest.raises(ValueError, match="base must be >= 1"):
        CoreShare(busy, 0, 1, calls.append)


def test_pace_sets_torch_on_the_calling_thread_only():
    busy = mp.get_context("spawn").RawValue("i", 0)
    before = torch.get_num_threads()
    seen = {}

    def passes():
        pace()
        seen["worker"] = torch.get_num_threads()

    share_cores(CoreShare(busy, 1, 1, torch.set_num_threads))
    try:
        worker = threading.Thread(target=passes)
        worker.start()
        worker.join()
        # a second thread sets its own count on its first pace, whatever the first did
        busy.value = 1
        other = threading.Thread(
            target=lambda: (pace(), seen.setdefault("busy", torch.get_num_threads()))
        )
        other.start()
        other.join()
    finally:
        share_cores(None)
        torch.set_num_threads(before)
    assert seen == {"worker": 2, "busy": 1}
    assert threads._SHARE == []
    pace()  # none installed: nothing happens
    assert torch.get_num_threads() == before


def _cfg(*extra):
    return load_config(None, ["run.threads=1", "pipeline.mode=one_step_off", *extra])


def test_share_applies_to_one_trainer_and_one_rollout_worker_on_spare_cores(monkeypatch):
    import rlpost.observe.mfu as mfu

    monkeypatch.setattr(mfu, "_usable_cores", lambda: 2)
    flag, lend = _core_share(_cfg())
    assert flag is not None and flag.value == 0 and lend == 1
    assert _core_share(_cfg("cluster.share_cores=false")) == (None, 0)
    assert _core_share(_cfg("cluster.rollout_workers=2")) == (None, 0)
    assert _core_share(_cfg("cluster.trainer_workers=2")) == (None, 0)
    assert _core_share(_cfg("run.threads=0")) == (None, 0)
    assert _core_share(_cfg("run.threads=2")) == (None, 0)  # no core beyond the trainer's
    monkeypatch.setattr(mfu, "_usable_cores", lambda: 8)
    assert _core_share(_cfg("run.threads=3"))[1] == 3
