"""Two replicas behind smg against one replica, under the same load.

    python -m loadtest.bench_cluster [--requests 64] [--ttft-trials 20] [--abort-trials 10]

  one       `tether serve --threads 1` (one pair)
  cluster   `tether cluster --replicas 2 --threads 1` (two pairs, smg round_robin in front, one
            shared SQLite store)
Figures:
  throughput  --requests mixed streaming chat requests at once (prompts 8..200 words, outputs
              16..--max-tokens tokens, ignore_eos, seeded): aggregate tokens/s = tokens / wall.
              Goal: cluster >= 1.8x one.
  ttft        --ttft-trials sequential one-token streams on the idle cluster, through smg and
              straight to a replica: the router's added TTFT is the difference of the p50s.
  aborts      --abort-trials streams dropped after 3 events, through smg and straight to a
              replica: tokens generated after the disconnect (per stream) and the daemons'
              disconnect-to-eviction latency, from the replicas' /metrics.
Writes cluster.json under results/bench-cluster-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.metrics import scrape, wait_settled
from loadtest.pair import REPO, ServerPair, free_port, tether_command
from loadtest.report import goal_line, results_dir, summary, write_json

MODEL = "builtin:tiny"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()


class ClusterRun:
    """`tether cluster` on free ports; replicas at --port + 1 + i."""

    def __init__(self, replicas: int, extra: Sequence[str]) -> None:
        self.port = free_port()
        self.replicas = replicas
        self.tmp = Path(tempfile.mkdtemp(prefix="tether-bc-"))
        self.cmd = [*tether_command(), "cluster", "--replicas", str(replicas),
                    "--port", str(self.port), "--runtime-dir", str(self.tmp / "run"),
                    "--state-dir", str(self.tmp / "state"), *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replica(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + i}"

    def __enter__(self) -> ClusterRun:
        log = open(self.tmp / "cluster.log", "wb")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while b"tether cluster:" not in (self.tmp / "cluster.log").read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tether cluster did not start:\n"
                                   + (self.tmp / "cluster.log").read_text(errors="replace"))
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def mixed_bodies(n: int, max_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"model": MODEL, "stream": True, "ignore_eos": True, "temperature": 0,
             "max_tokens": rng.randint(16, max_tokens),
             "messages": [{"role": "user", "content": " ".join(
                 rng.choice(WORDS) for _ in range(rng.randint(8, 200)))}]}
            for _ in range(n)]


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     drop_after: int | None = None) -> tuple[float | None, int]:
    """(TTFT in s, content events) of one chat stream; dropped after `drop_after` events."""
    t0 = time.perf_counter()
    ttft: float | None = None
    events = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            events += 1
            if drop_after is not None and events >= drop_after:
                break  # leaving the block closes the connection: the disconnect under test
    return ttft, events


async def throughput(url: str, bodies: list[dict[str, Any]], tokens_of: Any) -> dict[str, Any]:
    before = tokens_of()
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600.0) as client:
        results = await asyncio.gather(*(one_stream(client, url, b) for b in bodies))
    wall = time.perf_counter() - t0
    tokens = tokens_of() - before
    ttfts = [t for t, _ in results if t is not None]
    return {"requests": len(bodies), "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "ttft_s": summary(ttfts)}


async def ttft_trials(url: str, trials: int) -> list[float]:
    body = {"model": MODEL, "stream": True, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]}
    out = []
    async with httpx.AsyncClient(timeout=60.0) as client:
        for _ in range(trials):
            ttft, _ = await one_stream(client, url, body)
            if ttft is not None:
                out.append(ttft)
    return out


async def abort_trials(url: str, replicas: list[str], trials: int) -> dict[str, Any]:
    body = {"model": MODEL, "stream": True, "ignore_eos": True, "max_tokens": 1500,
            "messages": [{"role": "user", "content": "tell me everything"}]}
    before = [scrape(r) for r in replicas]
    async with httpx.AsyncClient(timeout=60.0) as client:
        for _ in range(trials):
            await one_stream(client, url, body, drop_after=3)
    baseline = {g: 0.0 for g in ("tether_requests_running", "tether_kv_cache_blocks_used")}
    for r in replicas:
        wait_settled(r, baseline, within=30.0)
    after = [scrape(r) for r in replicas]

    def delta(name: str) -> float:
        return sum(a.total(name) - b.total(name) for a, b in zip(after, before, strict=True))

    count = delta("tether_abort_latency_seconds_count")
    return {"trials": trials, "aborts": count,
            "tokens_after_disconnect_per_stream": delta("tether_tokens_after_disconnect_total")
            / trials,
            "abort_latency_mean_s": delta("tether_abort_latency_seconds_sum") / count
            if count else None}


def total_tokens(urls: list[str]) -> Any:
    return lambda: sum(scrape(u).total("tether_generation_tokens_total") for u in urls)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bodies = mixed_bodies(args.requests, args.max_tokens)
    extra = ["--threads", "1", "--log-format", "text"]
    out: dict[str, Any] = {}
    with ServerPair(extra_args=extra) as one:
        out["one"] = await throughput(one.base_url, bodies, total_tokens([one.base_url]))
    with ClusterRun(2, extra) as c:
        replicas = [c.replica(i) for i in range(2)]
        out["cluster"] = await throughput(c.router, bodies, total_tokens(replicas))
        routed, direct = await ttft_trials(c.router, args.ttft_trials), \
            await ttft_trials(replicas[0], args.ttft_trials)
        out["ttft"] = {"router": summary(routed), "direct": summary(direct)}
        out["aborts"] = {"router": await abort_trials(c.router, replicas, args.abort_trials),
                         "direct": await abort_trials(replicas[0], replicas, args.abort_trials)}
    return out


def report(r: dict[str, Any]) -> None:
    speedup = r["cluster"]["tokens_per_s"] / r["one"]["tokens_per_s"]
    print(f"throughput, {r['one']['requests']} mixed requests: one replica "
          f"{r['one']['tokens_per_s']:.1f} tok/s, two behind smg "
          f"{r['cluster']['tokens_per_s']:.1f} tok/s")
    print(goal_line("cluster / one", speedup, ">= 1.8x", speedup >= 1.8, "x"))
    p50 = {k: r["ttft"][k]["p50"] for k in ("router", "direct")}
    if None not in p50.values():
        print(f"TTFT p50 through smg {p50['router'] * 1000:.2f} ms, direct "
              f"{p50['direct'] * 1000:.2f} ms: the router adds "
              f"{(p50['router'] - p50['direct']) * 1000:.2f} ms")
    for way, a in r["aborts"].items():
        lat = a["abort_latency_mean_s"]
        print(f"aborts {way}: {a['aborts']:.0f}/{a['trials']} evicted, "
              f"{a['tokens_after_disconnect_per_stream']:.2f} tokens after the disconnect per "
              f"stream, latency mean {'-' if lat is None else f'{lat * 1000:.2f} ms'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-trials", type=int, default=20)
    parser.add_argument("--abort-trials", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    report(results)
    path = write_json(results_dir(args.out, "bench-cluster") / "cluster.json",
                      {"args": vars(args), **results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
