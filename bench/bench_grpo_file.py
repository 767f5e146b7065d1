"""A user's own task through ``grpo_file`` on a real checkpoint: held-out accuracy and peak RSS.

Writes a JSONL task that the recipes never saw (sums and differences asked in words, and
one-step stories of things bought or given away; the answer is a plain number) and runs
``rlpost train grpo_file``
exactly as the README tells a user, plus only the run's shape (``--prompts`` x ``--n``,
``--steps``, ``--threads``) and ``--set`` overrides. Held-out accuracy at T=1 comes from the
run's own evaluation before and after training (with its standard error); peak RSS is the run's
process tree, sampled every 0.5 s, which is also read as each step's row lands.

    python bench/bench_grpo_file.py --model ~/.cache/rlpost/models/SmolLM2-135M-Instruct \\
        [--steps 20] [--prompts 8] [--n 8] [--threads 2] [--eval 200] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

NAMES = ["Sam", "Ana", "Tom", "Lia", "Omar", "Mei", "Ivan", "Zoe", "Ravi", "Nora"]
THINGS = ["apples", "books", "coins", "marbles", "stickers", "pencils", "cards", "shells"]
UP = [
    "{n} has {a} {t} and buys {b} more. How many {t} does {n} have now?",
    "{n} had {a} {t}. A friend gave {n} {b} more. How many {t} does {n} have?",
    "There are {a} {t} in a box and {n} puts in {b} more. How many {t} are in the box?",
]
DOWN = [
    "{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?",
    "{n} had {a} {t} and lost {b} of them. How many {t} are left?",
    "A shelf holds {a} {t}. {n} takes {b} away. How many {t} are still on the shelf?",
]


ASK = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?"]


def word_problems(count: int, seed: int) -> list[dict[str, str]]:
    """Half bare sums and differences asked in words, half one-step stories."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        n, t = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if rng.random() < 0.5:
            op, answer = rng.choice([("+", a + b), ("-", a)])
            q = rng.choice(ASK).format(a=a + b if op == "-" else a, op=op, b=b)
        elif rng.random() < 0.5:
            q, answer = rng.choice(UP).format(n=n, t=t, a=a, b=b), a + b
        else:
            q, answer = rng.choice(DOWN).format(n=n, t=t, a=a + b, b=b), a
        rows.append({"question": q, "answer": str(answer)})
    return rows


def write_task(root: Path, train: int, held_out: int) -> tuple[Path, Path]:
    paths = root / "train.jsonl", root / "test.jsonl"
    for path, rows in zip(
        paths, (word_problems(train, 1), word_problems(held_out, 2)), strict=True
    ):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def last_step(runs: Path) -> int:
    """The newest trained step in the run's ``metrics.jsonl`` (0 before the first)."""
    steps = [0]
    for path in runs.glob("*/metrics.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            steps.append(row.get("step", 0) if "loss" in row else 0)
    return max(steps)


def sample_rss(proc: subprocess.Popen, runs: Path, seen: dict, done: threading.Event) -> None:
    """The process tree's RSS every 0.5 s: its peak, and its value as each step's row lands
    (whether a step keeps memory it does not need is read there)."""
    root = psutil.Process(proc.pid)
    while not done.is_set():
        try:
            tree = [root, *root.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in tree) / 2**20
        except psutil.Error:
            rss = 0.0  # a child exited between listing and reading; the next sample counts it
        seen["peak"] = max(seen["peak"], rss)
        step = last_step(runs)
        if rss and step and step not in seen["by_step"]:
            seen["by_step"][step] = round(rss)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local HF checkpoint directory or .gguf")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=1000)
    parser.add_argument("--eval", type=int, default=200, help="held-out problems")
    parser.add_argument("--out", default=None, help="run directory parent (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    args = parser.parse_args(argv)

    root = Path(args.out or tempfile.mkdtemp(prefix="grpo_file_"))
    root.mkdir(parents=True, exist_ok=True)
    train_path, test_path = write_task(root, args.train_rows, args.eval)
    command = [
        sys.executable, "-m", "rlpost.cli", "train", "grpo_file",
        f"model.path={args.model}",
        f"data.task.train_path={train_path}",
        f"data.task.eval_path={test_path}",
        "data.task.prompt_field=question",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"train.steps={args.steps}",
        f"run.threads={args.threads}",
        f"run.output_dir={root / 'runs'}",
        *args.set,
    ]  # fmt: skip
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(command)
    seen, done = {"peak": 0.0, "by_step": {}}, threading.Event()
    sampler = threading.Thread(
        target=sample_rss, args=(proc, root / "runs", seen, done), daemon=True
    )
    sampler.start()
    code = proc.wait()
    done.set()
    sampler.join()
    wall = time.perf_counter() - started
    if code != 0:
        print(f"the run exited {code}", file=sys.stderr)
        return code
    summary = json.loads(next((root / "runs").glob("*/summary.json")).read_text())
    print(
        json.dumps(
            {
                "wall_s": round(wall, 1),
                "peak_rss_mib": round(seen["peak"]),
                "rss_mib_by_step": seen["by_step"],
                **summary,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
