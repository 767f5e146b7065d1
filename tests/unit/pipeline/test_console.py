"""The console: a long phase says what it does and shows a bar beside the RL steps' bar."""

from __future__ import annotations

import io

from rich.console import Console as RichConsole

from rlpost.pipeline.console import Console


def console(enabled: bool = True) -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(enabled, out=RichConsole(file=text, width=120)), text


def test_a_phase_says_what_it_does_and_counts_its_work():
    c, text = console()
    with c.phase("held-out evaluation: 5 problems x 4 samples at T=1") as phase:
        phase.grow(20)
        phase.advance(8, "samples")
        task = c.progress.tasks[-1]
        assert (task.total, task.completed) == (20, 8)
        assert c.progress.live.is_started
    assert "held-out evaluation: 5 problems x 4 samples at T=1 ..." in text.getvalue()
    assert not c.progress.tasks and not c.progress.live.is_started


def test_a_phase_during_rl_steps_leaves_their_bar_running():
    c, _ = console()
    c.start(total=10, completed=2)
    with c.phase("held-out evaluation: 5 problems, greedy"):
        assert len(c.progress.tasks) == 2
    assert [t.description for t in c.progress.tasks] == ["rl"]
    assert c.progress.live.is_started
    c.stop()


def test_a_finished_warm_up_bar_is_not_drawn_again_under_the_rl_bar():
    c, _ = console()
    task = c.task("sft warm-up", 3)
    c.advance(task)
    c.done(task)  # stopped early: the bar ends where it is
    c.start(total=10, completed=0)
    assert [t.description for t in c.progress.tasks] == ["rl"]
    c.stop()


def test_progress_false_prints_nothing():
    c, text = console(enabled=False)
    with c.phase("loading the model from /m") as phase:
        phase.grow(1)
        phase.advance(1)
    assert text.getvalue() == ""


def test_the_end_of_run_table_shows_held_out_accuracy_with_its_standard_error(tmp_path):
    c, text = console(enabled=False)  # the table shows with progress off too
    summary = {
        "eval_temperature": 1.0,
        "eval_accuracy_start": 0.0,
        "eval_accuracy_end": 0.4,
        "eval_accuracy_stderr_start": 0.0,  # all wrong: measured, not missing
        "eval_accuracy_stderr_end": 0.0346,
        "eval_greedy_accuracy_start": 0.1,
        "eval_greedy_accuracy_end": 0.5,
        "eval_greedy_accuracy_stderr_start": 0.03,
        "eval_greedy_accuracy_stderr_end": 0.05,
        "reward_mean_first": 0.0,
        "reward_mean_last": 0.4,
        "steps": 10,
        "wall_seconds": 12.0,
    }
    c.summary(summary, tmp_path)
    rows = {
        line.split("│")[1].strip(): line for line in text.getvalue().splitlines() if "│" in line
    }
    t_row = rows["held-out accuracy (T=1) ± 1 s.e."]
    assert "0.0% ± 0.0" in t_row and "40.0% ± 3.5" in t_row
    greedy = rows["held-out accuracy (greedy) ± 1 s.e."]
    assert "10.0% ± 3.0" in greedy and "50.0% ± 5.0" in greedy
