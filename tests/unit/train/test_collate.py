"""collate lays rows out left-padded prompts, right-padded responses, one tensor per field."""

import torch

from rlpost.train.batch import collate
from rlpost.types import Completion


def test_collate_layout_by_hand():
    rows = [
        Completion([5, 6], [7, 8, 9], [-0.5, -1.0, -1.5], "stop", 2, 0, loss_mask=[1, 0, 1]),
        Completion([4], [], [], "length", 1, 1),  # an empty response
        Completion([1, 2, 3], [3], [-2.0], "stop", 0, 2, token_versions=[4]),
    ]
    b = collate(rows, [1.0, 0.0, 0.5], pad_id=0)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[0, 5, 6, 7, 8, 9], [0, 0, 4, 0, 0, 0], [1, 2, 3, 3, 0, 0]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 3, 4], [0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 3, 3]]
    assert b.responses.tolist() == [[7, 8, 9], [0, 0, 0], [3, 0, 0]]
    assert b.response_mask.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert b.rollout_logprobs.tolist() == [[-0.5, -1.0, -1.5], [0.0] * 3, [-2.0, 0.0, 0.0]]
    assert b.token_versions.tolist() == [[2, 2, 2], [-1, -1, -1], [4, -1, -1]]
    assert b.group.tolist() == [0, 1, 2] and b.scores.tolist() == [1.0, 0.0, 0.5]
    assert b.input_ids.dtype == torch.long and b.response_mask.dtype == torch.float32
