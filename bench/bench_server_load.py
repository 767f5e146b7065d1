"""`rlpost serve` under load: many concurrent clients, slow header-tricklers, memory before/after.

Starts one server on 127.0.0.1 (API key and admin key set, as off loopback)
and drives it with ``--concurrency`` clients sending ``--requests`` requests
in all: completions, chat, and every ``--stream-every``-th one streamed. Meanwhile
``--tricklers`` slow clients send request heads one byte every
``--trickle-s`` seconds and reconnect when the server cuts them off (the
header timeout). Reported: requests served, errors by HTTP status and by
exception, p50/p99 latency of served requests, trickler connections cut off,
and the server's resident memory before the load (after a warm-up round),
after each of ``--rounds`` rounds of load, and after it settled: the prefix
cache (``--prefix-cache-tokens`` in the server) fills during the first
round, so memory steps up once and then holds; a leak would climb every round.

A request is *accepted* when the server did not refuse it for load (429,
503); every accepted request must be served (200 and, when streamed, a
``[DONE]``): the report's ``accepted_not_served`` is the goal's 0.

    python bench/bench_server_load.py [--concurrency 64] [--requests 2000] [--tricklers 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' shared helpers
import serve_util

API, ADMIN = "load-test-key", "load-test-admin"


@dataclass
class Report:
    requests: int = 0
    served: int = 0
    status: Counter = field(default_factory=Counter)
    exceptions: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    tricklers_cut: int = 0
    broken_streams: list = field(default_factory=list)  # last lines of streams cut short
    seconds: float = 0.0

    @property
    def accepted_not_served(self) -> int:
        refused = self.status[429] + self.status[503]
        return self.requests - refused - self.served

    def summary(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        return {
            "requests": self.requests,
            "served": self.served,
            "accepted_not_served": self.accepted_not_served,
            "status": dict(sorted(self.status.items())),
            "exceptions": dict(self.exceptions),
            "p50_ms": round(1000 * statistics.median(lat), 1),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1),
            "requests_per_s": round(self.served / self.seconds, 1) if self.seconds else 0.0,
            "tricklers_cut": self.tricklers_cut,
            "broken_streams": self.broken_streams[:3],
        }


def start_server(model_dir: Path | None, *flags: str) -> tuple[subprocess.Popen, str]:
    """One keyed ``rlpost serve`` on 127.0.0.1, a free port, one thread; (process, URL)."""
    keys = {"RLPOST_API_KEY": API, "RLPOST_ADMIN_KEY": ADMIN}
    return serve_util.start_server(model_dir, "--threads", "1", *flags, env=keys)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def request_for(i: int, stream_every: int, max_tokens: int) -> tuple[str, dict]:
    body = {"max_tokens": max_tokens, "temperature": 1.0, "seed": i}
    if stream_every and i % stream_every == 0:
        body["stream"] = True
    if i % 3 == 1:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"{i}"}]}
    return "/v1/completions", {**body, "prompt": f"{i % 50}+{i % 7}=", "n": 1 + i % 4}


async def one_request(client: httpx.AsyncClient, path: str, body: dict, report: Report) -> None:
    start = time.perf_counter()
    report.requests += 1
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as r:
                report.status[r.status_code] += 1
                lines = [line async for line in r.aiter_lines()]
                ok = r.status_code == 200 and "data: [DONE]" in lines
                if r.status_code == 200 and not ok:
                    report.broken_streams.append(lines[-3:])
        else:
            r = await client.post(path, json=body)
            report.status[r.status_code] += 1
            ok = r.status_code == 200 and len(r.json()["choices"]) >= 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        report.exceptions[type(exc).__name__] += 1
        return
    if ok:
        report.served += 1
        report.latencies.append(time.perf_counter() - start)


async def trickler(host: str, port: int, every_s: float, stop: asyncio.Event, report: Report):
    """Sends a request head one byte at a time, reconnecting whenever the server cuts it off."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    while not stop.is_set():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for byte in head:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                try:  # wait between bytes, watching for the server closing the connection
                    if await asyncio.wait_for(reader.read(1), every_s) == b"":
                        report.tricklers_cut += 1
                        break
                except TimeoutError:
                    pass  # the server said nothing yet: send the next byte
        except (ConnectionError, OSError):
            report.tricklers_cut += 1
        finally:
            writer.close()


async def drive(url: str, args, report: Report) -> None:
    """Run the load: ``args.concurrency`` clients over ``args.requests`` requests, plus tricklers."""
    host, port = url.removeprefix("http://").split(":")
    stop = asyncio.Event()
    slow = [
        asyncio.create_task(trickler(host, int(port), args.trickle_s, stop, report))
        for _ in range(args.tricklers)
    ]
    numbers = iter(range(args.requests))
    headers = {"Authorization": f"Bearer {API}"}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as c:

        async def worker():
            for i in numbers:
                await one_request(c, *request_for(i, args.stream_every, args.max_tokens), report)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        report.seconds = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*slow, return_exceptions=True)


def run(model_dir: Path | None, args) -> dict:
    """Start a server, warm it up, load it ``args.rounds`` times, let it settle; the numbers."""
    flags = ["--max-pending", str(args.max_pending), "--header-timeout", str(args.header_timeout)]
    proc, url = start_server(model_dir, *flags)
    try:
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency, "tricklers": 0})
        asyncio.run(drive(url, warm, Report()))
        before = rss_bytes(proc.pid)
        reports, after_rounds = [], []
        for _ in range(args.rounds):
            reports.append(Report())
            asyncio.run(drive(url, args, reports[-1]))
            after_rounds.append(round(rss_bytes(proc.pid) / 2**20, 1))
        time.sleep(args.settle_s)
        health = httpx.get(f"{url}/health", timeout=10).json()
        return {
            **reports[-1].summary(),
            "rounds": [r.summary() for r in reports[:-1]],
            "concurrency": args.concurrency,
            "tricklers": args.tricklers,
            "rss_mib_before": round(before / 2**20, 1),
            "rss_mib_after_each_round": after_rounds,
            "rss_mib_settled": round(rss_bytes(proc.pid) / 2**20, 1),
            "server_active_after": health["active"],
            "server_pending_after": health["http"]["pending"],
            "prefix_cache_tokens_after": health["prefix_cache"]["tokens"],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--model", help="HF checkpoint directory (default: the built-in tiny model)")
    add("--concurrency", type=int, default=64)
    add("--requests", type=int, default=2000)
    add("--tricklers", type=int, default=32)
    add("--trickle-s", type=float, default=0.5, help="seconds between a trickler's bytes")
    add("--stream-every", type=int, default=4, help="every k-th request is streamed (0: none)")
    add("--max-tokens", type=int, default=16)
    add("--max-pending", type=int, default=256, help="the server's --max-pending")
    add("--header-timeout", type=float, default=10.0, help="the server's --header-timeout")
    add("--settle-s", type=float, default=5.0, help="seconds before the settled memory reading")
    add("--rounds", type=int, default=1, help="load rounds (memory after each: a leak grows)")
    return ap


if __name__ == "__main__":
    a = parser().parse_args()
    print(json.dumps(run(Path(a.model) if a.model else None, a), indent=2))
