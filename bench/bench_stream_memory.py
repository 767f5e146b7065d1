"""Peak memory of a file source loaded whole against the same file streamed.

    python bench/bench_stream_memory.py                 # files of 50 and 200 MB
    python bench/bench_stream_memory.py --sizes 20,80 --buffer 10000

Generates JSONL files of ``--sizes`` MB (rows of about 1 KB: a prompt, an answer and a
padding column), then, each in its own process so its peak RSS (``ru_maxrss``) is its own:
``load`` reads the file as a non-streamed source does (``load_prompt_file``: every row a
Prompt in memory); ``stream`` draws one whole epoch from a ``StreamSampler`` with a
``--buffer``-row shuffle buffer (``stream: true``). Each prints its peak RSS above the
process's RSS after its imports. The last lines are the ratios: load against stream at the
largest file, and each side's largest file against its smallest (streaming stays flat:
its memory is the buffer, not the file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import resource, sys, json
from rlpost.data.files import load_prompt_file
from rlpost.data.stream import StreamSampler
side, path, buffer = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if side == "load":
    rows = len(load_prompt_file(path)[0])
else:
    s = StreamSampler(path, name="s", fit=lambda ps, r: ps, buffer=buffer, seed=0, on_bad_row="skip")
    rows = 0
    while s.epoch == 0:
        s.next_batch()
        rows += 1
    rows -= 1  # the last draw was the next epoch's first row
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rows": rows, "peak_mb": (peak - base) / 1024}))
"""


def write_file(path: Path, megabytes: int) -> int:
    pad = "x" * 900
    rows = 0
    with path.open("w") as f:
        while f.tell() < megabytes * 1_000_000:
            f.write(
                json.dumps({"prompt": f"What is {rows} + 1?", "answer": str(rows + 1), "pad": pad})
            )
            f.write("\n")
            rows += 1
    return rows


def measure(side: str, path: Path, buffer: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, side, str(path), str(buffer)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50,200", help="file sizes in MB, comma separated")
    ap.add_argument("--buffer", type=int, default=10000, help="the stream's shuffle_buffer")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    peaks: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mb in sizes:
            path = Path(tmp) / f"rows_{mb}mb.jsonl"
            n = write_file(path, mb)
            for side in ("load", "stream"):
                got = measure(side, path, args.buffer)
                assert got["rows"] == n, (side, got, n)
                peaks[side, mb] = got["peak_mb"]
                print(f"{side:6s} {mb:4d} MB file, {n} rows: peak RSS +{got['peak_mb']:.0f} MB")
            path.unlink()
    small, large = min(sizes), max(sizes)
    print(f"load / stream at {large} MB: {peaks['load', large] / peaks['stream', large]:.1f}x")
    for side in ("load", "stream"):
        growth = peaks[side, large] / peaks[side, small]
        print(f"{side} {large} MB / {small} MB: {growth:.2f}x (the file is {large / small:.0f}x)")


if __name__ == "__main__":
    main()
