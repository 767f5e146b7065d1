"""What the user sees: a live progress bar and the end-of-run table (rich)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class Console:
    """Progress for warm-up and RL steps; quiet when ``enabled`` is False (tests, CI logs)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.out = RichConsole(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.out,
            disable=not enabled,
        )
        self._rl_task = None
        self._eval = ""

    def task(self, name: str, total: int):
        self.progress.start()
        return self.progress.add_task(name, total=total, info="")

    def advance(self, task, info: str = "") -> None:
        self.progress.update(task, advance=1, info=info)

    def done(self, task) -> None:
        self.progress.stop()

    def start(self, total: int, completed: int) -> None:
        self.progress.start()
        self._rl_task = self.progress.add_task(
            "rl", total=total, completed=completed, info=self._eval
        )

    def note_eval(self, step: int, metrics: dict) -> None:
        if "eval_accuracy" in metrics:
            self._eval = f"held-out {metrics['eval_accuracy']:.1%}"
            if self.enabled:
                self.out.print(f"step {step}: held-out accuracy {metrics['eval_accuracy']:.1%}")

    def update(self, step: int, m: dict) -> None:
        if "eval_accuracy" in m:
            self.note_eval(step, m)
        info = (
            f"reward {m.get('reward_mean', 0):.3f} | {self._eval} | kl {m.get('kl', 0):.4f} | "
            f"clip {m.get('clip_frac', 0):.1%} | {m.get('rollout_tps', 0):,.0f} tok/s"
        )
        if self._rl_task is not None:
            self.progress.update(self._rl_task, completed=step, info=info)

    def stop(self) -> None:
        self.progress.stop()

    def summary(self, s: dict, run_dir: Path) -> None:
        table = Table(title=f"rlpost run {run_dir}")
        table.add_column("")
        table.add_column("start", justify="right")
        table.add_column("end", justify="right")
        table.add_row(
            f"held-out accuracy (T={s['eval_temperature']:g})",
            _pct(s["eval_accuracy_start"], s.get("eval_accuracy_stderr_start")),
            _pct(s["eval_accuracy_end"], s.get("eval_accuracy_stderr_end")),
        )
        if s.get("eval_greedy_accuracy_start") is not None:
            table.add_row(
                "held-out accuracy (greedy)",
                _pct(s["eval_greedy_accuracy_start"]),
                _pct(s["eval_greedy_accuracy_end"]),
            )
        for name, entry in (s.get("eval_sets") or {}).items():  # eval.sets: one row a metric
            for key in entry:
                if key.endswith("_start") and not key.startswith("reward_mean"):
                    m = key.removesuffix("_start")
                    table.add_row(f"{name} {m}", _pct(entry[key]), _pct(entry.get(f"{m}_end")))
        table.add_row("train reward", _num(s["reward_mean_first"]), _num(s["reward_mean_last"]))
        table.add_row("steps", "", str(s["steps"]))
        table.add_row("wall time", "", f"{s['wall_seconds']:.0f} s")
        self.out.print(table)
        self.out.print(f"metrics: {run_dir / 'metrics.jsonl'}   plot: {run_dir / 'curves.png'}")


def _pct(v, stderr=None) -> str:
    """A percentage, with its standard error when it is an average over several samples."""
    if v is None:
        return "-"
    return f"{v:.1%}" if not stderr else f"{v:.1%} ± {stderr * 100:.1f}"


def _num(v) -> str:
    return "-" if v is None else f"{v:.3f}"
