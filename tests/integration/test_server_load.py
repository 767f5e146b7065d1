"""A short run of bench/bench_server_load.py: concurrent clients, tricklers, a pending bound,
then the same load beside stalled readers, slow bodies and requests at the work caps.

Nothing accepted is dropped (every request not refused with 429/503 is served),
no normal request fails under the hostile mix,
no client sees a broken connection, the server is idle afterwards and its
memory is back near its level before the load. No timings are asserted.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_server_load.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_server_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_load_with_slow_clients_drops_nothing_accepted(tiny_dir):
    bench = _bench()
    flags = "--concurrency 16 --requests 160 --tricklers 8 --header-timeout 1"
    flags += " --trickle-s 0.2 --settle-s 1 --max-tokens 8 --stalled 1 --slow-bodies 2 --huge 1"
    # Scoring clients are left out here: their work runs on executor threads, whose malloc
    # arenas keep RSS above this bound after they finish; test_server_hostile bounds them.
    flags += " --scorers 0"
    args = bench.parser().parse_args(flags.split())
    result = bench.run(tiny_dir, args)
    assert result["requests"] == 160 and result["served"] > 0, result
    assert result["accepted_not_served"] == 0 and result["exceptions"] == {}, result
    assert set(result["status"]) <= {200, 429}  # refused for load, or served
    assert result["server_active_after"] == 0 and result["server_pending_after"] == 0
    assert result["rss_mib_settled"] < result["rss_mib_before"] + 64
    # The same load next to a stalled reader, slow bodies and requests at the caps.
    assert result["normal_failed"] == 0, result
    assert result["normal_with_hostile"]["served"] == 160
    hostile = result["hostile"]
    assert hostile.get("slow_body_408", 0) >= 1 and hostile.get("stalled_sent", 0) >= 1
