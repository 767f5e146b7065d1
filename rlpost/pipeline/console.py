"""What the user sees: a live progress bar and the end-of-run table (rich).

Every long phase starts with one line (which reaches a non-terminal log too) and shows a bar;
``observe.progress=false`` keeps only the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class Console:
    """Progress for warm-up and RL steps; quiet when ``enabled`` is False (tests, CI logs)."""

    def __init__(self, enabled: bool = True, out: RichConsole | None = None) -> None:
        self.enabled = enabled
        self.out = out or RichConsole(stderr=True)
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
        """End ``task``'s bar where it is (a stopped warm-up ends early)."""
        done = next(t for t in self.progress.tasks if t.id == task)
        end = done.completed if done.total is not None else 1  # a length unknown until now
        self.progress.update(task, total=end, completed=end)
        self._settle()

    @contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[Phase]:
        """A bar for one long phase (``total`` None: unknown), removed at its end beside a
        running bar, else left printed with its time."""
        if self.enabled:
            self.out.print(f"{name} ...")
        self.progress.start()
        task = self.progress.add_task(name, total=total, info="")
        try:
            yield Phase(self.progress, task)
        finally:
            if any(t.id != task for t in self.progress.tasks):
                self.progress.remove_task(task)
            else:
                self.done(task)

    def _settle(self) -> None:
        """Stop the live display once no bar is running; the finished bars stay printed."""
        if all(t.finished for t in self.progress.tasks):
            self.progress.stop()
            for t in list(self.progress.tasks):
                self.progress.remove_task(t.id)

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
        temperature = f"T={s['eval_temperature']:g}"
        for how, key in ((temperature, "eval_accuracy"), ("greedy", "eval_greedy_accuracy")):
            if key == "eval_accuracy" or s.get(f"{key}_start") is not None:
                ends = [_pct(s[f"{key}_{e}"], s.get(f"{key}_stderr_{e}")) for e in ("start", "end")]
                table.add_row(f"held-out accuracy ({how}) ± 1 s.e.", *ends)
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


class Phase:
    """The bar of one phase: ``grow`` adds to its total as the phase learns it (a held-out
    evaluation of several sets), ``advance`` counts work done."""

    def __init__(self, progress: Progress, task) -> None:
        self.progress, self.task = progress, task

    def grow(self, n: int) -> None:
        task = next(t for t in self.progress.tasks if t.id == self.task)
        self.progress.update(self.task, total=(task.total or 0) + n)

    def advance(self, n: int, info: str = "") -> None:
        self.progress.update(self.task, advance=n, info=info)


def _pct(v, stderr=None) -> str:
    """A percentage, with its standard error (in percentage points) when one was measured:
    0 too, which a held-out set that is all right or all wrong has."""
    if v is None:
        return "-"
    return f"{v:.1%}" if stderr is None else f"{v:.1%} ± {stderr * 100:.1f}"


def _num(v) -> str:
    return "-" if v is None else f"{v:.3f}"
