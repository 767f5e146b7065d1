"""Two pipeline stages (each rank holds half the decoder layers, gloo on 127.0.0.1) train
as one trainer in this process: the same logprobs, loss, gradient norm and weights over
five GRPO steps, and checkpoints that resume across the layouts. A layout the model or
the workers cannot take is refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from rlpost.cluster.process import start_trainers
from rlpost.config import ConfigError
from rlpost.errors import WorkerError
from rlpost.pipeline import build, rules
from rlpost.pipeline.memory import model_shape, rank_params
from rlpost.train.dp import DPSpec, held_numel
from rlpost.train.pp import one_f_one_b, split_error, stage_ranges
from tests.integration.test_tensor_parallel import (
    STEPS,
    _batch,
    _cfg,
    _close,
    _same_steps,
    _step,
    resumes_both_ways,
    smollm2_steps,
    started_pair,
)

PP2 = ("cluster.trainer_workers=2", "cluster.pipeline_parallel=2")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp")
    yield from started_pair(tmp, *PP2)


def test_five_grpo_steps_at_pp2_equal_one_process(pair, tmp_path):
    """Two optimizer steps a GRPO step, the clip acting; then a checkpoint written at PP=2
    resumes in one process and one process's at PP=2, with the same next step."""
    cfg, tok, one, group = pair
    model = one.trainer.model
    layers = model.model.layers
    first = sum(p.numel() for i in stage_ranges(len(layers), 2)[0] for p in layers[i].parameters())
    later = sum(p.numel() for p in layers.parameters()) - first
    assert later > 0 and group.describe()["parameters_held"] == held_numel(model) - later
    assert rank_params(cfg, model_shape(cfg)) == group.describe()["parameters_held"]  # preflight
    _same_steps(cfg, tok, one, group)
    assert one.version() == group.version() == STEPS

    resumes_both_ways(cfg, tok, one, group, tmp_path)


def test_one_optimizer_step_a_batch_returns_the_last_stages_old_logprobs(tmp_path):
    """With one optimizer step a batch the loss pass's own logprobs are the old ones: only
    the last stage computes them, and every rank returns them, as one process does."""
    _, tok, one, group = next(gen := started_pair(tmp_path, *PP2, "train.mini_batch_size=16"))
    try:
        batch = _batch(one.trainer.model, tok, seed=3)
        r1, r2 = one.update(batch, beta=0.0), group.update(batch, beta=0.0)
        mask = batch.response_mask > 0
        assert r1.old_logprobs[mask].abs().min() > 0
        assert torch.allclose(r1.old_logprobs, r2.old_logprobs, rtol=1e-5, atol=1e-6)
        assert _close(r1.stats["loss"], r2.stats["loss"])
    finally:
        next(gen, None)


def test_a_checkpoint_written_at_tp2_resumes_at_pp2(pair, tmp_path):
    """The layouts write one format: two tensor-parallel ranks' checkpoint, after a step,
    loads into the two stages, and the next step is the same on both."""
    _, tok, one, group = pair
    tp_cfg = _cfg(tmp_path, "cluster.trainer_workers=2", "cluster.tensor_parallel=2")
    tp = start_trainers(tp_cfg, tmp_path)
    try:
        _step(tp, _batch(one.trainer.model, tok, seed=11))
        tp.save(tmp_path / "tp2")
        group.restore(tmp_path / "tp2", version=1)
        batch = _batch(one.trainer.model, tok, seed=12)
        _, r_tp = _step(tp, batch)
        _, r_pp = _step(group, batch)
    finally:
        tp.close()
    for key in ("loss", "grad_norm"):
        assert _close(r_tp.stats[key], r_pp.stats[key]), (key, r_tp.stats, r_pp.stats)


def test_a_killed_stage_stops_the_group_in_one_line(pair):
    """The last stage's process dies; the first, blocked in a hand-off to it, does not hang
    the run. Runs last of the tests on the shared group: it leaves the group unusable."""
    _, tok, one, group = pair
    _kill_and_expect_one_line(group, _batch(one.trainer.model, tok, seed=21), rank=1, world=2)
    group.close()  # stops rank 0, blocked or not, and returns


def test_a_stage_killed_before_the_update_stops_the_group_in_one_line(tmp_path):
    """The logprobs are scored, then the last stage dies: the first stage, sending its
    activations and waiting for their gradient point to point, does not hang the run."""
    _, tok, one, group = next(gen := started_pair(tmp_path, *PP2))
    try:
        b = _batch(one.trainer.model, tok, seed=5)
        b.old_logprobs, b.ref_logprobs = group.logprobs(b, "old"), group.logprobs(b, "ref")
        group.handles[1].kill()
        with pytest.raises(WorkerError, match=r"trainer rank [01] of 2 failed in update") as err:
            group.update(b, beta=0.05)
        assert "rank 1: trainer-1 worker process exited" in str(err.value)
        assert "\n" not in str(err.value)
    finally:
        next(gen, None)


def _kill_and_expect_one_line(group, batch, *, rank: int, world: int) -> None:
    """Kill ``rank``; the next step fails with one line naming it, no hang."""
    group.handles[rank].kill()
    match = rf"trainer rank [0-{world - 1}] of {world} failed in logprobs"
    with pytest.raises(WorkerError, match=match) as err:
        _step(group, batch)
    assert f"rank {rank}: trainer-{rank} worker process exited" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_killed_rank_of_stages_of_tensor_parallel_ranks_stops_the_group_in_one_line(tmp_path):
    """2 stages x TP 2: the last stage's second tensor-parallel rank dies mid-run; the three
    others, blocked in its all-reduces or hand-offs, do not hang the run."""
    layout = ("cluster.trainer_workers=4", "cluster.pipeline_parallel=2")
    started = started_pair(tmp_path, *layout, "cluster.tensor_parallel=2")
    _, tok, one, group = next(started)
    _kill_and_expect_one_line(group, _batch(one.trainer.model, tok, seed=21), rank=3, world=4)
    next(started, None)  # closes the group: every rank stopped, blocked or not


def test_stages_pack_their_rows_as_one_process(tmp_path):
    """Ranks that split the model run every row, so they pack rows as one process does
    (only data-parallel ranks, which cut micro-batches by rows, pad)."""
    cfg = _cfg(
        tmp_path, "cluster.trainer_workers=2", "cluster.pipeline_parallel=2", "train.packing=on"
    )
    model, tok = build.build_policy(cfg)
    one = build.build_trainer_worker(cfg, model, tok)
    group = start_trainers(cfg, tmp_path)
    try:
        assert one.describe()["packing"] == group.describe()["packing"] == "rows"
        _same_steps(cfg, tok, one, group, steps=2)
    finally:
        group.close()


def test_stages_are_consecutive_and_balanced():
    assert stage_ranges(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_ranges(2, 2) == [range(0, 1), range(1, 2)]


def _makespan(pp: int, micro_batches: int, order=one_f_one_b) -> int:
    """Ticks until ``pp`` stages finish their ``order``, a pass taking one tick, a stage
    waiting for its input (the previous stage's forward, the next stage's backward)."""
    todo = [order(pp, s, micro_batches) for s in range(pp)]
    done, ticks = set(), 0
    while any(todo):
        ready = []
        for s, ops in enumerate(todo):
            if ops:
                op, i = ops[0]
                need = (op, s - 1 if op == "F" else s + 1, i)
                if (need[1] in (-1, pp) or need in done) and (op == "F" or ("F", s, i) in done):
                    ready.append((op, s, i))
        assert ready, f"the stages wait on each other: {todo}"
        for _, s, _ in ready:
            todo[s].pop(0)
        done |= set(ready)
        ticks += 1
    return ticks


@pytest.mark.parametrize(("pp", "micro_batches"), [(2, 1), (2, 3), (3, 4), (4, 8)])
def test_the_stages_overlap_micro_batches_one_forward_one_backward(pp, micro_batches):
    """Each pass once; stage s keeps at most P - s micro-batches in flight; the stages
    finish in 2 (M + P - 1) passes' time, against 2 M P one stage at a time."""
    for s in range(pp):
        order = one_f_one_b(pp, s, micro_batches)
        assert sorted(order) == sorted((op, i) for op in "FB" for i in range(micro_batches))
        flight = [
            sum(1 if op == "F" else -1 for op, _ in order[: k + 1]) for k in range(len(order))
        ]
        assert max(flight) == min(pp - s, micro_batches)
    assert _makespan(pp, micro_batches) == 2 * (micro_batches + pp - 1)

    def in_turn(pp, s, m):
        return [(op, i) for i in range(m) for op in "FB"]

    assert _makespan(pp, micro_batches, in_turn) == 2 * micro_batches * pp


def test_more_stages_than_layers_is_refused_in_one_line():
    line = split_error(LlamaConfig(num_hidden_layers=2), 3)
    assert line == (
        "cluster.pipeline_parallel=3 is more stages than the model's num_hidden_layers=2; "
        "use at most 2"
    )
    assert split_error(LlamaConfig(num_hidden_layers=2), 2) is None


def test_stages_of_tensor_parallel_ranks_that_do_not_divide_the_workers_are_refused(tmp_path):
    cfg = _cfg(
        tmp_path,
        "cluster.trainer_workers=6",
        "cluster.pipeline_parallel=2",
        "cluster.tensor_parallel=2",
    )
    with pytest.raises(ConfigError) as err:
        rules.check(cfg)
    assert str(err.value) == (
        "cluster.pipeline_parallel=2 x cluster.tensor_parallel=2 does not divide "
        "cluster.trainer_workers=6; set trainer_workers to a multiple of 4 "
        "(data-parallel x pipeline stages x tensor-parallel)"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        # two data-parallel replicas (FSDP2 over the dp axis) of two stages, each stage's
        # layers sharded over its replicas; the rows split between the replicas
        ("cluster.trainer_workers=4", "cluster.pipeline_parallel=2"),
        # two stages, each a layer split over two tensor-parallel ranks (the embedding and
        # head by vocabulary, the head in chunks)
        (
            "cluster.trainer_workers=4",
            "cluster.pipeline_parallel=2",
            "cluster.tensor_parallel=2",
            "train.logits_chunk_tokens=5",
        ),
        # the same with the whole-logits head (the tiny vocabulary's default), 4 layers, 8
        # heads on 4 KV heads: the last stage's own lookup took no part in its backward
        (
            "cluster.trainer_workers=4",
            "cluster.pipeline_parallel=2",
            "cluster.tensor_parallel=2",
            "model.tiny.num_hidden_layers=4",
            "model.tiny.num_attention_heads=8",
            "model.tiny.num_key_value_heads=4",
        ),
    ],
    ids=["dp2xpp2", "pp2xtp2", "pp2xtp2_whole_logits"],
)
def test_four_ranks_with_two_stages_equal_one_process(tmp_path, layout):
    """Four ranks against one process; then their checkpoint resumes in one process with
    the same next step."""
    cfg = _cfg(tmp_path, *layout)
    model, tok = build.build_policy(cfg)
    one = build.build_trainer_worker(cfg, model, tok)
    group = start_trainers(cfg, tmp_path)
    try:
        held = group.describe()["parameters_held"]
        assert held == rank_params(cfg, model_shape(cfg)) < held_numel(model) / 2
        _same_steps(cfg, tok, one, group)
        group.save(tmp_path / "four")
        batch = _batch(one.trainer.model, tok, seed=STEPS)
        _, r_group = _step(group, batch)
        solo = build.build_trainer_worker(cfg, build.build_policy(cfg)[0], tok)
        solo.restore(tmp_path / "four", version=STEPS)
        _, r_solo = _step(solo, batch)
        for key in ("loss", "grad_norm"):
            assert _close(r_solo.stats[key], r_group.stats[key]), (key, r_solo.stats)
    finally:
        group.close()


def test_too_many_stages_are_refused_before_any_group(tmp_path):
    """Refused in the worker's build, before it waits for the other ranks."""
    cfg = _cfg(tmp_path, "cluster.trainer_workers=3", "cluster.pipeline_parallel=3")
    model, tok = build.build_policy(cfg)
    with pytest.raises(ConfigError, match="more stages than the model's num_hidden_layers=2"):
        build.build_trainer_worker(cfg, model, tok, dp=DPSpec(rank=0, world=3))


@pytest.mark.slow
def test_smollm2_at_pp2_equals_one_trainer_process(tmp_path):
    """SmolLM2-135M-Instruct's 30 layers in two stages of 15."""
    smollm2_steps(tmp_path, "cluster.trainer_workers=2", "cluster.pipeline_parallel=2")
