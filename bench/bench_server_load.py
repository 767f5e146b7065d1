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

Then the same load runs again with a hostile mix alongside, from a process of its own (``--stalled``
clients that send a large streaming request through a 4 KiB receive buffer
and never read, ``--slow-bodies`` clients that trickle a body byte by byte,
``--huge`` clients sending requests at the server's work caps, 1024 sequences
each, ``--scorers`` clients sending ``/v1/prompt_logprobs`` requests of 256 prompts x 120
tokens, every other one given up after 0.5 s): the normal requests' p50/p99 with and without the mix, their ratio,
and how many normal requests failed (the goal: none), with the CPU seconds the server spent
in each run (``server_cpu_s``) and the hostile clients' process in all (``hostile.cpu_s``).

    python bench/bench_server_load.py [--concurrency 64] [--requests 2000] [--tricklers 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


STALLED_BODY = {
    "messages": [{"role": "user", "content": "1+"}],
    "n": 32,
    "max_tokens": 100,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
    "ignore_eos": True,
}  # fmt: skip  ~10 MB of events: more than every buffer between server and client holds


async def stalled_reader(host: str, port: int, stop: asyncio.Event, hostile: Counter) -> None:
    """Sends a large streaming request through a 4 KiB receive buffer and never reads;
    reconnects once the server has cut it (``--write-timeout``)."""
    body = json.dumps(STALLED_BODY).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, head.encode() + body)
            hostile["stalled_sent"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 6.0)  # hold it past the write timeout
        except OSError:
            hostile["stalled_errors"] += 1
        finally:
            sock.close()


async def slow_body(host: str, port: int, stop: asyncio.Event, hostile: Counter) -> None:
    """Sends a request head, then its body one byte every 0.2 s, until the server answers."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API}\r\n"
    head += "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n"
    while not stop.is_set():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head.encode())
            for _ in range(4000):
                writer.write(b" ")
                await writer.drain()
                try:
                    answer = await asyncio.wait_for(reader.read(64), 0.2)
                except TimeoutError:
                    continue
                hostile[f"slow_body_{answer[9:12].decode() or 'closed'}"] += 1
                break
        except (ConnectionError, OSError):
            hostile["slow_body_cut"] += 1
        finally:
            writer.close()


async def huge(client: httpx.AsyncClient, stop: asyncio.Event, hostile: Counter) -> None:
    """Requests at the server's default work caps: 16 prompts x n 64 = 1024 sequences."""
    body = {"prompt": [f"{i}+{i}=" for i in range(16)], "n": 64, "max_tokens": 16}
    while not stop.is_set():
        try:
            r = await client.post("/v1/completions", json=body)
            hostile[f"huge_{r.status_code}"] += 1
        except httpx.HTTPError as exc:
            hostile[f"huge_{type(exc).__name__}"] += 1


async def scorer(client: httpx.AsyncClient, stop: asyncio.Event, hostile: Counter) -> None:
    """Large scoring requests; every other one the client gives up on (the server must stop)."""
    body = {"prompts": [[(i + j) % 90 for j in range(120)] for i in range(256)]}
    body["starts"] = [1] * 256
    n = 0
    while not stop.is_set():
        n += 1
        try:
            r = await client.post("/v1/prompt_logprobs", json=body, timeout=0.5 if n % 2 else 600)
            hostile[f"score_{r.status_code}"] += 1
        except httpx.HTTPError as exc:
            hostile[f"score_{type(exc).__name__}"] += 1


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


def hostile_mix(url: str, args, stop, out) -> None:
    """The hostile clients, in a process of their own (as they would be on other machines:
    their own parsing must not delay the normal clients' clocks) until ``stop`` is set;
    ``out`` gets "ready" once they run, then their counts."""

    async def mix() -> None:
        host, port = url.removeprefix("http://").split(":")
        done, hostile = asyncio.Event(), Counter()
        headers = {"Authorization": f"Bearer {API}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as big:
            tasks = [stalled_reader(host, int(port), done, hostile) for _ in range(args.stalled)]
            tasks += [slow_body(host, int(port), done, hostile) for _ in range(args.slow_bodies)]
            tasks += [huge(big, done, hostile) for _ in range(args.huge)]
            tasks += [scorer(big, done, hostile) for _ in range(args.scorers)]
            running = [asyncio.create_task(t) for t in tasks]
            out.put("ready")
            while not stop.is_set():
                await asyncio.sleep(0.05)
            done.set()
            await asyncio.gather(*running, return_exceptions=True)
        hostile["cpu_s"] = round(cpu_seconds(os.getpid()), 1)
        out.put(dict(hostile))

    asyncio.run(mix())


def run(model_dir: Path | None, args) -> dict:
    """Start a server, warm it up, load it ``args.rounds`` times, let it settle; the numbers."""
    flags = ["--max-pending", str(args.max_pending), "--header-timeout", str(args.header_timeout)]
    flags += ["--write-timeout", str(args.write_timeout), "--body-timeout", str(args.body_timeout)]
    flags += ["--max-request-sequences", str(min(1024, args.max_pending))]
    flags += ["--threads", str(args.server_threads)] if args.server_threads else []
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
        mixed = hostile_round(url, args, proc.pid)
        time.sleep(args.settle_s)
        health = httpx.get(f"{url}/health", timeout=10).json()
        return {
            **reports[-1].summary(),
            **mixed,
            "rounds": [r.summary() for r in reports[:-1]],
            "concurrency": args.concurrency,
            "tricklers": args.tricklers,
            "rss_mib_before": round(before / 2**20, 1),
            "rss_mib_after_each_round": after_rounds,
            "rss_mib_settled": round(rss_bytes(proc.pid) / 2**20, 1),
            "server_active_after": health["active"],
            "server_pending_after": health["http"]["pending"],
            "server_write_timeouts": health["http"]["write_timeouts"],
            "prefix_cache_tokens_after": health["prefix_cache"]["tokens"],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def hostile_round(url: str, args, server: int) -> dict:
    """The same normal load without and with the hostile mix: latency of the normal requests,
    and the CPU seconds the server (pid ``server``) and the hostile clients spent in each."""
    if not (args.stalled or args.slow_bodies or args.huge or args.scorers):
        return {}
    quiet, mixed, hostile = Report(), Report(), Counter()
    plain = argparse.Namespace(**{**vars(args), "tricklers": 0})
    cpu = [cpu_seconds(server)]
    asyncio.run(drive(url, plain, quiet))
    cpu.append(cpu_seconds(server))
    ctx = multiprocessing.get_context("fork")  # the module may not be importable by name
    stop, out = ctx.Event(), ctx.Queue()
    clients = ctx.Process(target=hostile_mix, args=(url, args, stop, out), daemon=True)
    clients.start()
    try:
        if out.get(timeout=60) != "ready":
            raise RuntimeError("the hostile clients did not start")
        cpu.append(cpu_seconds(server))
        asyncio.run(drive(url, plain, mixed))
        cpu.append(cpu_seconds(server))
    finally:
        stop.set()
        hostile.update(out.get(timeout=120))
        clients.join(timeout=30)
    q, m = quiet.summary(), mixed.summary()
    return {
        "normal_alone": {k: q[k] for k in ("served", "p50_ms", "p99_ms", "status")},
        "normal_with_hostile": {k: m[k] for k in ("served", "p50_ms", "p99_ms", "status")},
        "p50_ratio": round(m["p50_ms"] / q["p50_ms"], 2) if q["p50_ms"] else None,
        "p99_ratio": round(m["p99_ms"] / q["p99_ms"], 2) if q["p99_ms"] else None,
        "normal_failed": mixed.requests - mixed.served + quiet.requests - quiet.served,
        "server_cpu_s": {
            "alone": round(cpu[1] - cpu[0], 1),
            "with_hostile": round(cpu[3] - cpu[2], 1),
        },
        "seconds": {"alone": round(quiet.seconds, 1), "with_hostile": round(mixed.seconds, 1)},
        "hostile": dict(sorted(hostile.items())),
    }


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
    add("--max-pending", type=int, default=4096, help="the server's --max-pending [sequences]")
    add("--header-timeout", type=float, default=10.0, help="the server's --header-timeout")
    add("--settle-s", type=float, default=5.0, help="seconds before the settled memory reading")
    add("--rounds", type=int, default=1, help="load rounds (memory after each: a leak grows)")
    add("--stalled", type=int, default=4, help="hostile: clients that never read a stream")
    add("--slow-bodies", type=int, default=8, help="hostile: clients trickling a body")
    add("--huge", type=int, default=1, help="hostile: clients sending requests at the caps")
    add("--scorers", type=int, default=2, help="hostile: clients sending big prompt_logprobs")
    add("--server-threads", type=int, default=0, help="the server's --threads (0: torch's)")
    add("--write-timeout", type=float, default=2.0, help="the server's --write-timeout")
    add("--body-timeout", type=float, default=2.0, help="the server's --body-timeout")
    return ap


if __name__ == "__main__":
    a = parser().parse_args()
    result = run(Path(a.model) if a.model else None, a)
    print(json.dumps(result, indent=2))
    if result.get("normal_failed"):
        raise SystemExit(f"{result['normal_failed']} normal requests failed under the hostile mix")
