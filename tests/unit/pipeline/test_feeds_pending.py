"""What a checkpoint records as drawn but not trained: a sync rollout that fails part way
(a lost worker) leaves its batch pending, so a resume generates it first."""

from __future__ import annotations

import pytest

from rlpost.data.sampler import PromptSampler
from rlpost.errors import WorkerError
from rlpost.pipeline.feeds import PromptSource, SyncFeed
from rlpost.pipeline.stages import RolloutSettings
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.types import Prompt


class LostRollout:
    def generate(self, prompts, params, n, *, train=False, last=False):
        raise WorkerError("rollout", "lost", "rollout-0 worker lost during generate")


def test_a_batch_drawn_by_a_failed_rollout_stays_pending():
    prompts = [Prompt(f"{i}+1=", answer=str(i + 1)) for i in range(8)]
    sampler = PromptSampler(prompts, batch_size=2, seed=0)
    source = PromptSource(sampler, pending=[[prompts[7]]])
    feed = SyncFeed(LostRollout(), None, source, SamplingParams(), RolloutSettings(2, 2))
    with pytest.raises(WorkerError):
        feed.next(1, 0, last=False)
    pending = feed.pending()
    assert pending == [[prompts[7]]]  # the handed-back batch it was generating
    with pytest.raises(WorkerError):
        feed.next(1, 0, last=False)  # the next try draws from the sampler
    drawn = feed.pending()
    assert len(drawn) == 2 and drawn[0] == [prompts[7]] and len(drawn[1]) == 2
    assert sampler.index == 2  # the cursor moved past the batch that is pending: none is lost
