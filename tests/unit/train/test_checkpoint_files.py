"""Checkpoint files: a step saved twice keeps a complete copy at every moment, ``latest`` is
replaced atomically, a broken marker falls back to the newest complete step, and pruning
never removes the checkpoint just written."""

from __future__ import annotations

import pytest

from rlpost.statefile import atomic_write, save_state
from rlpost.statefile import load_state as load_state_file
from rlpost.train.checkpoint import latest_checkpoint, load_state, save_checkpoint


def _parts(tag: str):
    def write(d):
        (d / "model.txt").write_text(tag)

    return write


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    save_checkpoint(tmp_path, 20, _parts("first"), {"x": 1}, keep=1)

    def failing(d):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 20, failing, {"x": 2}, keep=1)  # a second save that fails
    kept = latest_checkpoint(tmp_path)
    assert kept is not None and (kept / "model.txt").read_text() == "first"
    save_checkpoint(tmp_path, 20, _parts("second"), {"x": 3}, keep=1)
    kept = latest_checkpoint(tmp_path)
    assert (kept / "model.txt").read_text() == "second" and load_state(kept)["x"] == 3
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_20"]  # nothing half-written or replaced is left


def test_a_broken_marker_falls_back_to_the_newest_complete_step(tmp_path):
    for step in (100, 200):
        save_checkpoint(tmp_path, step, _parts(str(step)), {}, keep=3)
    (tmp_path / "checkpoints" / "latest").write_text("")  # torn
    assert latest_checkpoint(tmp_path).name == "step_200"
    (tmp_path / "checkpoints" / "latest").write_text("step_999")  # names nothing
    assert latest_checkpoint(tmp_path).name == "step_200"


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    for step in (100, 200):
        save_checkpoint(tmp_path, step, _parts(str(step)), {}, keep=2)
    out = save_checkpoint(tmp_path, 20, _parts("20"), {}, keep=2)  # after a rollback
    assert out.is_dir() and latest_checkpoint(tmp_path) == out
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert left == ["step_20", "step_200"]


def test_a_rollback_that_keeps_lr_cuts_applies_them_to_the_next_update(tmp_path):
    from rlpost.config import load_config
    from rlpost.pipeline import build
    from tests.conftest import small_overrides

    cfg = load_config(None, small_overrides(tmp_path, **{"train.optim.warmup_steps": 0}))
    model, tokenizer = build.build_policy(cfg)
    worker = build.build_trainer_worker(cfg, model, tokenizer)
    worker.save(tmp_path / "ckpt")
    before = worker.trainer.optimizer.param_groups[0]["lr"]
    worker.scale_lr(0.5)  # a guard cut the LR after the checkpoint
    worker.restore(tmp_path / "ckpt", version=0, keep_lr=True)
    assert worker.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(before * 0.5)
    assert worker.trainer.lr_scale.factor == 0.5  # the cut is its own state, not the schedule's
    worker.restore(tmp_path / "ckpt", version=0)  # a plain restore takes the checkpoint's LR
    assert worker.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(before)
    assert worker.trainer.lr_scale.factor == 1.0


def test_the_lr_cut_is_saved_with_the_checkpoint_and_old_states_load(tmp_path):
    import torch

    from rlpost.config import load_config
    from rlpost.pipeline import build
    from rlpost.train.worker import STATE_FILE
    from tests.conftest import small_overrides

    cfg = load_config(None, small_overrides(tmp_path, **{"train.optim.warmup_steps": 0}))
    model, tokenizer = build.build_policy(cfg)
    worker = build.build_trainer_worker(cfg, model, tokenizer)
    full = worker.trainer.optimizer.param_groups[0]["lr"]
    assert worker.scale_lr(0.25) == pytest.approx(full * 0.25)
    worker.save(tmp_path / "cut")
    fresh = build.build_trainer_worker(cfg, build.build_policy(cfg)[0], tokenizer)
    fresh.restore(tmp_path / "cut", version=3)
    assert fresh.trainer.lr_scale.factor == 0.25
    assert fresh.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(full * 0.25)
    # a state written before the LR scale was saved on its own: the factor reads as 1
    state = torch.load(tmp_path / "cut" / STATE_FILE, weights_only=False)
    del state["trainer"]["lr_scale"]
    torch.save(state, tmp_path / "cut" / STATE_FILE)
    fresh.restore(tmp_path / "cut", version=3)
    assert fresh.trainer.lr_scale.factor == 1.0


def test_links_planted_at_the_temporary_names_are_never_written_through(tmp_path):
    """Whoever can write the run directory plants links at fixed temporary names
    (``.latest.tmp``, ``.trainer_state.pt.tmp``, ``.step_N.tmp``, ``.step_N.old``), to a
    file and a directory outside it and to a path that does not exist yet: the saves
    succeed and nothing outside changes."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "file").write_text("mine")
    (outside / "dir" / "keep.txt").write_text("mine")
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    run = tmp_path / "run"
    root = run / "checkpoints"
    root.mkdir(parents=True)
    plants = {
        root / ".latest.tmp": outside / "file",
        root / ".step_1.tmp": outside / "dir",
        root / ".step_1.old": outside / "dir",
        run / ".trainer_state.pt.tmp": outside / "file",
        run / ".summary.json.tmp": outside / "new",
    }
    for link, target in plants.items():
        link.symlink_to(target)

    def parts(d):
        save_state({"w": 1}, d / "trainer_state.pt")

    save_checkpoint(run, 1, parts, {"x": 1})
    save_checkpoint(run, 1, parts, {"x": 2})  # again: the old copy moves to .step_1.old
    save_state({"w": 2}, run / "trainer_state.pt")
    with atomic_write(run / "summary.json", "w") as fh:
        fh.write("{}")
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
    assert not (outside / "new").exists()
    assert load_state(latest_checkpoint(run))["x"] == 2
    assert load_state_file(run / "trainer_state.pt") == {"w": 2}
    assert (run / "summary.json").read_text() == "{}"
    # the links at the file names stay where they were, pointing where they did; those at
    # the checkpoint's directory names were removed
    assert {p for p in run.rglob("*") if p.is_symlink()} == {
        link for link in plants if link.suffix == ".tmp" and link.name != ".step_1.tmp"
    }
