"""run.device: the one-line refusal of cuda without a GPU, auto, and moving batches."""

import pytest
import torch

from rlpost.config import ConfigError, load_config
from rlpost.pipeline.build import build_trainer_worker, run_device
from rlpost.pipeline.rules import check as check_names
from rlpost.resolved import resolve
from rlpost.train.batch import TrainBatch, collate
from rlpost.train.dp import DPSpec
from rlpost.types import Completion

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only behaviour")


def _meta(group: int) -> dict:
    return {"finish_reason": "stop", "policy_version": 0, "group": group}


def _batch() -> TrainBatch:
    cs = [
        Completion(prompt_ids=[1, 2, 3], token_ids=[4, 5], logprobs=[-0.5, -1.0], **_meta(0)),
        Completion(prompt_ids=[6], token_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3], **_meta(1)),
    ]
    b = collate(cs, [1.0, 0.0], pad_id=0)
    b.advantages = torch.ones_like(b.response_mask)
    b.old_logprobs = torch.zeros_like(b.response_mask)
    return b


def test_default_device_is_cpu():
    cfg = load_config(None, [])
    assert cfg.run.device == "cpu"
    assert run_device(resolve(cfg)) == torch.device("cpu")


@no_gpu
def test_cuda_without_gpu_is_one_line_config_error():
    cfg = load_config(None, ["run.device=cuda"])
    with pytest.raises(ConfigError) as err:
        check_names(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "run.device=cuda" in msg and "no GPU" in msg


@no_gpu
def test_auto_resolves_to_cpu_without_gpu():
    cfg = load_config(None, ["run.device=auto"])
    check_names(cfg)
    assert run_device(resolve(cfg)) == torch.device("cpu")


def test_unknown_device_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"run\.device"):
        load_config(None, ["run.device=tpu"])


def test_trainbatch_to_moves_every_tensor_field():
    b = _batch()
    moved = b.to("meta")
    tensor_fields = [k for k, v in vars(b).items() if isinstance(v, torch.Tensor)]
    assert {"input_ids", "advantages", "old_logprobs", "token_versions"} <= set(tensor_fields)
    for k in tensor_fields:
        t, orig = getattr(moved, k), getattr(b, k)
        assert t.device.type == "meta", k
        assert t.dtype == orig.dtype and t.shape == orig.shape, k
        assert orig.device.type == "cpu", k  # the source batch is left where it was
    assert moved.prompt_width == b.prompt_width and moved.returns is None


def test_trainbatch_to_same_device_keeps_the_tensors():
    b = _batch()
    same = b.to("cpu")
    for k, v in vars(b).items():
        if isinstance(v, torch.Tensor):
            assert getattr(same, k) is v, k


def test_data_parallel_backend_must_match_the_device(tiny):
    model, tok = tiny
    cfg = load_config(None, ["cluster.backend=process"])
    dp = DPSpec(rank=0, world=1, backend="gloo" if torch.cuda.is_available() else "nccl")
    if torch.cuda.is_available():
        cfg.run.device = "cuda"
    with pytest.raises(ConfigError, match="use gloo on cpu and nccl on cuda"):
        build_trainer_worker(cfg, model, tok, dp=dp)
