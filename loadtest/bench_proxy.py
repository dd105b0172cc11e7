"""SSE throughput of the whole proxy + pipe path, beside a bare Starlette stream; proxy memory.

    python loadtest/bench_proxy.py [--seconds 4] [--levels 1,10,50,100] [--held 1000] [--out DIR]

In one run, on the same cores and with the same client:
  bare   a Starlette StreamingResponse on uvicorn (h11, asyncio) yielding pre-made chat chunks
  tether `tether serve --model builtin:tiny`, completions streams with ignore_eos
at each of --levels concurrent streams (events/s, every SSE event counted, [DONE] included;
streams of 500 events/tokens, back to back), with the proxy's and the daemon's CPU per 1k events (the
engine's decode rate can be what limits tether's events/s), then the proxy's RSS idle and
while --held streams are open (per-stream KB; most of them queued in the daemon).
Goals (at 1 and 100 streams): tether >= 50% of bare; <= 20 KB per held stream. Anchor (this
machine class): bare 30k events/s on one stream, 61k over 100.
Writes proxy.json and throughput_vs_concurrency.png under results/bench-proxy-<timestamp>/
(or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import common
import orjson
import psutil
import sse_client

BARE_EVENT = b"data: " + orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bare",
    "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                 "finish_reason": None}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"
ANCHOR = {"bare_1": 30000, "bare_100": 61000}
GOAL_LEVELS = (1, 100)


# --- the bare reference server (runs in its own process) -------------------------------------


def serve_bare(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def events(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield BARE_EVENT
        yield DONE

    async def stream(request: Request) -> Response:
        body = orjson.loads(await request.body())
        return StreamingResponse(events(int(body["max_tokens"])), media_type="text/event-stream")

    async def health(_request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/completions", stream, methods=["POST"]),
                            Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, http="h11", loop="asyncio",
                log_level="warning")


def start_bare() -> tuple[subprocess.Popen[bytes], str]:
    port = common.free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-bare", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not common.health_ok(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the bare server did not start")
        time.sleep(0.1)
    return proc, url


# --- throughput ------------------------------------------------------------------------------


async def events_per_s(url: str, body: Callable[[], dict[str, Any]], streams: int,
                       seconds: float) -> dict[str, Any]:
    """`streams` clients, each issuing back-to-back streams until `seconds` have passed."""
    counts = {"events": 0, "requests": 0, "errors": 0}
    deadline = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < deadline:
            try:
                async with sse_client.stream(url, "/v1/completions", body()) as resp:
                    got = await resp.count_events()
                counts["events"] += got
                counts["requests"] += 1
            except (OSError, sse_client.HttpError, asyncio.IncompleteReadError):
                counts["errors"] += 1
                await asyncio.sleep(0.05)

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(streams)))
    elapsed = time.monotonic() - start
    return {**counts, "seconds": elapsed, "events_per_s": counts["events"] / elapsed}


def body_maker(model: str, tokens: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {"model": model, "prompt": "hi", "max_tokens": tokens, "ignore_eos": True,
                "stream": True}
    return make


# --- memory ----------------------------------------------------------------------------------


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def rss_kb(proc: psutil.Process) -> float:
    return float(proc.memory_info().rss) / 1024


async def held_streams_rss(url: str, model: str, proxy: psutil.Process, held: int,
                           metric: Callable[[str], float]) -> dict[str, Any]:
    """Proxy RSS idle, then with `held` streams open (most of them queued in the daemon)."""
    idle = rss_kb(proxy)
    gate = asyncio.Semaphore(100)
    opened: list[sse_client.Response] = []

    async def open_one() -> None:
        async with gate:
            # Queued streams get their headers only when they start: do not wait for them.
            opened.append(await sse_client.send(url, "POST", "/v1/completions",
                                                body_maker(model, 1500)(),
                                                {"Accept": "text/event-stream"}))

    await asyncio.gather(*(open_one() for _ in range(held)))
    readers = [asyncio.create_task(r.count_events()) for r in opened]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric("tether_proxy_sessions") >= held:
            break
        await asyncio.sleep(0.1)
    sessions = metric("tether_proxy_sessions")
    await asyncio.sleep(1.0)
    with_held = rss_kb(proxy)
    for r in opened:
        r.close()
    for t in readers:
        t.cancel()
    results = await asyncio.gather(*readers, return_exceptions=True)
    failed = sum(1 for r in results if isinstance(r, Exception))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metric("tether_requests_running") + metric("tether_requests_waiting") <= 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    return {"held": len(opened), "proxy_sessions_seen": sessions, "reader_errors": failed,
            "rss_idle_kb": idle, "rss_held_kb": with_held,
            "rss_after_release_kb": rss_kb(proxy),
            "kb_per_held_stream": (with_held - idle) / max(1.0, sessions)}


# --- driver ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace, bare_url: str, pair: common.ServerPair) -> dict[str, Any]:
    model = common.served_model(pair.base_url) or "default"
    out: dict[str, Any] = {"model": model, "seconds": args.seconds, "levels": args.levels}
    procs = pair.processes()
    for streams in args.levels:
        out[f"bare_{streams}"] = await events_per_s(bare_url, body_maker("bare", 500),
                                                    streams, args.seconds)
        cpu0 = {name: cpu_s(p) for name, p in procs.items()}
        cell = await events_per_s(pair.base_url, body_maker(model, 500), streams,
                                  args.seconds)
        # The engine may be what limits events/s; CPU per event shows what the proxy costs.
        for name, p in procs.items():
            cell[f"{name}_cpu_ms_per_1k_events"] = (
                (cpu_s(p) - cpu0[name]) * 1e6 / max(1, cell["events"]))
        out[f"tether_{streams}"] = cell
        await asyncio.sleep(0.5)
    proxy = procs["proxy"]

    def metric(name: str) -> float:
        return common.scrape(pair.base_url).total(name)

    out["memory"] = await held_streams_rss(pair.base_url, model, proxy, args.held, metric)
    return out


def report(res: dict[str, Any]) -> None:
    print(f"\n=== proxy benchmark (model {res['model']}, {res['seconds']:g} s per cell) ===")
    print(f"  {'streams':>8} {'bare ev/s':>12} {'tether ev/s':>12} {'ratio':>7}   anchor bare")
    for streams in res["levels"]:
        bare = res[f"bare_{streams}"]["events_per_s"]
        ours = res[f"tether_{streams}"]["events_per_s"]
        ratio = ours / bare if bare else 0.0
        anchor = ANCHOR.get(f"bare_{streams}")
        print(f"  {streams:>8} {bare:>12.0f} {ours:>12.0f} {ratio:>7.2f}   "
              f"{'-' if anchor is None else anchor:>6}")
        if streams not in GOAL_LEVELS:
            continue
        print(common.goal_line(f"tether / bare at {streams} stream(s)", ratio, ">= 0.5",
                               ratio >= 0.5))
        cell = res[f"tether_{streams}"]
        per_1k = cell["proxy_cpu_ms_per_1k_events"]
        ceiling = 1e6 / per_1k if per_1k else float("inf")
        print(f"           CPU per 1k events: proxy {per_1k:.0f} ms, daemon "
              f"{cell['daemon_cpu_ms_per_1k_events']:.0f} ms; proxy ceiling ~{ceiling:.0f} "
              "events per CPU-second")
    mem = res["memory"]
    print(f"  proxy RSS idle {mem['rss_idle_kb'] / 1024:.1f} MiB, with "
          f"{mem['proxy_sessions_seen']:.0f} held "
          f"streams {mem['rss_held_kb'] / 1024:.1f} MiB, after release "
          f"{mem['rss_after_release_kb'] / 1024:.1f} MiB")
    print(common.goal_line("KB per held stream", mem["kb_per_held_stream"], "<= 20",
                           mem["kb_per_held_stream"] <= 20, " KB"))


def plot(path: Path, res: dict[str, Any]) -> Path:
    levels = res["levels"]
    series = {name: [res[f"{name}_{n}"]["events_per_s"] for n in levels]
              for name in ("bare", "tether")}
    return common.plot_lines(path, levels, series, "concurrent streams", "SSE events/s",
                             f"Throughput vs concurrency (model {res['model']})",
                             logx=True, logy=True, marker="o")


def levels_arg(text: str) -> list[int]:
    levels = sorted({int(v) for v in text.split(",") if v.strip()})
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("want comma-separated stream counts >= 1")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput cell")
    parser.add_argument("--levels", type=levels_arg, default=[1, 10, 50, 100],
                        help="concurrent streams per cell, comma-separated")
    parser.add_argument("--held", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve-bare", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare is not None:
        serve_bare(args.serve_bare)
        return 0
    common.raise_fd_limit(4 * args.held + 1024)
    out = common.results_dir(args.out, "bench-proxy")
    bare, bare_url = start_bare()
    try:
        with common.ServerPair(model="builtin:tiny", max_num_seqs=args.max_num_seqs) as pair:
            res = asyncio.run(run(args, bare_url, pair))
    finally:
        bare.terminate()
        bare.wait(10)
    report(res)
    common.write_json(out / "proxy.json", res)
    plot(out / "throughput_vs_concurrency.png", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
