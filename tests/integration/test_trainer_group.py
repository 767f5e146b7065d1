"""Two data-parallel trainer processes behind a TrainerGroup answer every trainer call as
one trainer in this process does: logprobs, updates, exported weights, checkpoints that
resume on either side, and a failing rank stops the group in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from rlpost.algos import get_advantage_estimator, scores_to_token_rewards
from rlpost.cluster.process import start_trainers
from rlpost.config import load_config
from rlpost.errors import WorkerError
from rlpost.models.loading import load_causal_lm
from rlpost.pipeline import build, rules
from rlpost.rollout.engines.hf import HFEngine
from rlpost.rollout.engines.protocol import SamplingParams
from rlpost.train.batch import collate


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.threads=1",
            "model.tiny.hidden_size=32",
            "model.tiny.intermediate_size=64",
            "train.mini_batch_size=8",  # two optimizer steps for 13 rows
            "train.micro_batch_size=3",
            "train.optim.lr=3e-3",
            "algo.kl.beta=0.05",  # a reference policy, sharded too
            "cluster.backend=process",
            *extra,
        ],
    )


def _batch(model, tok):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ["12+7=", "3-9=", "20+11="]]
    cs = HFEngine(model, tok, seed=0).generate(ids, SamplingParams(max_tokens=6), n=5)[:13]
    scores = [float(i % 5 < 2) for i in range(len(cs))]
    b = collate(cs, scores, tok.pad_token_id)
    b.advantages, _ = get_advantage_estimator("grpo")(
        scores_to_token_rewards(b.scores, b.response_mask), b.response_mask, b.group
    )
    return b


def _close(a, b, rel=1e-5):
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("group")
    cfg = _cfg(tmp, "cluster.trainer_workers=2")
    model, tok = build.build_policy(cfg)
    batch = _batch(model, tok)
    one = build.build_trainer_worker(cfg, copy.deepcopy(model), tok)
    group = start_trainers(cfg, tmp)
    yield cfg, tmp, batch, one, group
    group.close()


def _step(worker, batch):
    b = copy.deepcopy(batch)
    b.old_logprobs = worker.logprobs(b, "old")
    b.ref_logprobs = worker.logprobs(b, "ref")
    return b, worker.update(b, beta=0.05)


def test_the_group_answers_as_one_trainer(pair, tmp_path):
    cfg, _, batch, one, group = pair
    assert group.describe()["trainer_workers"] == 2
    assert group.describe()["has_reference"] and group.version() == 0
    mask = batch.response_mask > 0
    for which in ("old", "ref", "sum_pi_squared"):
        a, b = one.logprobs(batch, which), group.logprobs(batch, which)
        assert a.shape == b.shape == batch.response_mask.shape
        assert torch.allclose(a[mask], b[mask], rtol=1e-5, atol=1e-5), which
    _, r1 = _step(one, batch)
    _, r2 = _step(group, batch)
    assert r1.version == r2.version == 1 and r2.stats["updates"] == 2
    for key in ("loss", "pg_loss", "grad_norm", "clip_frac"):
        assert _close(r1.stats[key], r2.stats[key]), (key, r1.stats[key], r2.stats[key])
    e1, e2 = one.export_weights(), group.export_weights()
    assert [n for n, _ in e1.tensors] == [n for n, _ in e2.tensors] and e1.version == e2.version
    for (n, x), (_, y) in zip(e1.tensors, e2.tensors, strict=True):
        assert x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-6), n
    moved = dict(e2.tensors)
    start = dict(build.build_policy(cfg)[0].named_parameters())
    assert not torch.allclose(moved["model.norm.weight"], start["model.norm.weight"])

    # save through the group: the files one trainer writes, the weights just exported
    group.save(tmp_path / "dp")
    one.save(tmp_path / "one")
    saved = load_causal_lm(tmp_path / "dp" / "model").state_dict()
    for n, x in e2.tensors:
        assert torch.equal(saved[n], x), n
    assert (tmp_path / "dp" / "ref_model" / "config.json").is_file()

    # a second step after restoring: the optimizer state came back too
    _step(group, batch)
    assert group.restore(tmp_path / "dp", version=1) == 1
    for n, x in group.export_weights().tensors:
        assert torch.equal(moved[n], x), n
    _, r2b = _step(group, batch)
    _, r1b = _step(one, batch)
    assert _close(r1b.stats["loss"], r2b.stats["loss"], 1e-4)
    assert _close(r1b.stats["grad_norm"], r2b.stats["grad_norm"], 1e-4)

    # checkpoints cross over: the group's resumes on one trainer, and one trainer's on the group
    _, tok = build.build_policy(cfg)
    solo = build.build_trainer_worker(cfg, build.build_policy(cfg)[0], tok)
    solo.restore(tmp_path / "dp", version=1)
    _, r3 = _step(solo, batch)
    assert _close(r3.stats["loss"], r1b.stats["loss"], 1e-4)
    assert _close(r3.stats["grad_norm"], r1b.stats["grad_norm"], 1e-4)
    group.restore(tmp_path / "one", version=1)
    _, r4 = _step(group, batch)
    assert _close(r4.stats["grad_norm"], r1b.stats["grad_norm"], 1e-4)


def test_on_policy_update_fills_old_logprobs_for_every_row(pair):
    _, _, batch, one, group = pair
    sub = batch.select(torch.arange(7))  # one optimizer step; rank 1's share ends in padding
    out = []
    for worker in (one, group):
        b = copy.deepcopy(sub)
        b.old_logprobs, b.ref_logprobs = None, worker.logprobs(b, "ref")
        out.append(worker.update(b, beta=0.05).old_logprobs)
    mask = sub.response_mask > 0
    assert out[1].shape == sub.response_mask.shape
    assert torch.allclose(out[0][mask], out[1][mask], atol=1e-4)
    assert (out[1][mask] < 0).all()  # every row filled: logprobs of sampled tokens


def test_an_error_on_every_rank_is_one_line_and_the_group_goes_on(pair):
    _, _, batch, _, group = pair
    b = copy.deepcopy(batch)
    b.old_logprobs = None  # two optimizer steps need them up front
    with pytest.raises(WorkerError, match=r"rank [01] of 2 failed in update") as err:
        group.update(b, beta=0.05)
    assert "needs batch.old_logprobs" in str(err.value) and "\n" not in str(err.value)
    assert group.version() >= 1


def test_a_killed_rank_stops_the_group_in_one_line(pair):
    """Runs last of the tests on the shared group: it leaves the group unusable."""
    _, _, batch, _, group = pair
    group.handles[1].kill()
    with pytest.raises(WorkerError, match=r"trainer rank [01] of 2 failed in logprobs") as err:
        group.logprobs(batch, "old")
    message = str(err.value)
    assert "rank 1: trainer-1 worker process exited" in message and "\n" not in message
    with pytest.raises(WorkerError, match="unusable"):
        group.version()
    group.close()  # stops rank 0, blocked or not, and returns


def test_local_backend_with_two_trainers_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "cluster.trainer_workers=2", "cluster.backend=local")
    with pytest.raises(ValueError, match=r"cluster\.backend=process") as err:
        rules.check(cfg)
    assert "\n" not in str(err.value).split("\n")[-1]


def test_auto_backend_puts_two_trainers_in_processes(tmp_path):
    from rlpost.cluster import starter
    from rlpost.cluster.process import start_process_workers

    cfg = _cfg(tmp_path, "cluster.trainer_workers=2", "cluster.backend=auto")
    assert starter(cfg) is start_process_workers


def test_a_critic_under_data_parallel_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "cluster.trainer_workers=2", "algo.advantage=gae")
    with pytest.raises(ValueError, match="trainer_workers=1"):
        rules.check(cfg)


@pytest.mark.slow
def test_a_run_on_two_trainer_processes_matches_one_trainer(tmp_path):
    """The loop end to end (warm-up, rollout in its own process, checkpoints, evaluation)
    with two data-parallel trainers steps as with one trainer in this process."""
    from rlpost.cluster.process import start_process_workers
    from rlpost.pipeline.loop import train

    def run(name, *extra):
        cfg = load_config(
            None,
            [
                f"run.output_dir={tmp_path}",
                f"run.name={name}",
                "run.threads=1",
                "sft.steps=40",
                "sft.batch_size=32",
                "train.steps=3",
                "rollout.prompts_per_step=8",
                "rollout.n=4",
                "rollout.max_tokens=6",
                "train.mini_batch_size=16",  # two optimizer steps per batch
                "train.micro_batch_size=8",
                "train.optim.lr=3e-3",
                "eval.limit=8",
                "eval.every=3",
                "checkpoint.every=3",
                "observe.progress=false",
                "observe.plot=false",
                # data-parallel ranks pad; one trainer would pack, whose float rounding
                # differs (a zero-advantage step's gradient norm is 1e-4, not 0)
                "train.packing=off",
                *extra,
            ],
        )
        return train(cfg, start=start_process_workers if extra else None)

    local = run("local")
    spread = run("dp2", "cluster.backend=process", "cluster.trainer_workers=2")
    assert len(local.history) == len(spread.history) == 3
    for a, b in zip(local.history, spread.history, strict=True):
        assert b["reward_mean"] == a["reward_mean"], a["step"]
        for key in ("loss", "pg_loss", "kl", "grad_norm", "clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
    assert spread.summary["eval_accuracy_end"] == local.summary["eval_accuracy_end"]
    assert (spread.run_dir / "checkpoints" / "step_3" / "model" / "config.json").is_file()


@pytest.mark.slow
def test_smollm2_on_two_data_parallel_ranks_equals_one_process(tmp_path):
    """FSDP2 over two ranks on SmolLM2-135M-Instruct: five GRPO steps against one trainer
    process (each rank takes three of the six rows)."""
    from tests.integration.test_tensor_parallel import SMOLLM2_GRAD_REL, smollm2_steps

    smollm2_steps(tmp_path, "cluster.trainer_workers=2", grad_rel=SMOLLM2_GRAD_REL)
