"""SSE throughput of the whole proxy + pipe path, beside a bare Starlette stream; proxy memory.

    python loadtest/bench_proxy.py [--seconds 5] [--held 1000] [--out DIR]

In one run, on the same cores and with the same client:
  bare   a Starlette StreamingResponse on uvicorn (h11, asyncio) yielding pre-made chat chunks
  tether `tether serve --model builtin:tiny`, completions streams with ignore_eos
at 1 and 100 concurrent streams (events/s, every SSE event counted, [DONE] included), then the
proxy's RSS idle and while --held streams are open (per-stream KB).
Goals: tether >= 50% of bare; <= 20 KB per held stream. Anchor (this machine class): bare 30k
events/s on one stream, 61k over 100.
Writes proxy.json under results/bench-proxy-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
                    counts["events"] += await resp.count_events()
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


def rss_kb(proc: psutil.Process) -> float:
    return float(proc.memory_info().rss) / 1024


async def held_streams_rss(url: str, model: str, proxy: psutil.Process, held: int,
                           pair_busy: Callable[[], float]) -> dict[str, Any]:
    idle = rss_kb(proxy)
    gate = asyncio.Semaphore(100)
    opened: list[sse_client.Response] = []
    failures = 0

    async def open_one() -> None:
        nonlocal failures
        async with gate:
            try:
                resp = await sse_client.request(url, "POST", "/v1/completions",
                                                body_maker(model, 1500)(),
                                                {"Accept": "text/event-stream"})
            except OSError:
                failures += 1
                return
        if resp.status != 200:
            failures += 1
            resp.close()
            return
        opened.append(resp)

    await asyncio.gather(*(open_one() for _ in range(held)))
    readers = [asyncio.create_task(r.count_events()) for r in opened]
    await asyncio.sleep(2.0)
    with_held = rss_kb(proxy)
    for r in opened:
        r.close()
    for t in readers:
        t.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if pair_busy() <= 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    return {"held": len(opened), "failed": failures, "rss_idle_kb": idle,
            "rss_held_kb": with_held, "rss_after_release_kb": rss_kb(proxy),
            "kb_per_held_stream": (with_held - idle) / max(1, len(opened))}


# --- driver ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace, bare_url: str, pair: common.ServerPair) -> dict[str, Any]:
    model = common.served_model(pair.base_url) or "default"
    out: dict[str, Any] = {"model": model, "seconds": args.seconds}
    for streams, tokens in ((1, 2000), (100, 200)):
        out[f"bare_{streams}"] = await events_per_s(bare_url, body_maker("bare", tokens),
                                                    streams, args.seconds)
        out[f"tether_{streams}"] = await events_per_s(pair.base_url, body_maker(model, tokens),
                                                      streams, args.seconds)
        await asyncio.sleep(0.5)
    proxy = pair.processes()["proxy"]

    def busy() -> float:
        m = common.scrape(pair.base_url)
        return m.total("tether_requests_running") + m.total("tether_requests_waiting")

    out["memory"] = await held_streams_rss(pair.base_url, model, proxy, args.held, busy)
    return out


def report(res: dict[str, Any]) -> None:
    print(f"\n=== proxy benchmark (model {res['model']}, {res['seconds']:g} s per cell) ===")
    print(f"  {'streams':>8} {'bare ev/s':>12} {'tether ev/s':>12} {'ratio':>7}   anchor bare")
    for streams in (1, 100):
        bare = res[f"bare_{streams}"]["events_per_s"]
        ours = res[f"tether_{streams}"]["events_per_s"]
        ratio = ours / bare if bare else 0.0
        print(f"  {streams:>8} {bare:>12.0f} {ours:>12.0f} {ratio:>7.2f}   "
              f"{ANCHOR[f'bare_{streams}']:>6}")
        print(common.goal_line(f"tether / bare at {streams} stream(s)", ratio, ">= 0.5",
                               ratio >= 0.5))
    mem = res["memory"]
    print(f"  proxy RSS idle {mem['rss_idle_kb'] / 1024:.1f} MiB, with {mem['held']} held "
          f"streams {mem['rss_held_kb'] / 1024:.1f} MiB, after release "
          f"{mem['rss_after_release_kb'] / 1024:.1f} MiB")
    print(common.goal_line("KB per held stream", mem["kb_per_held_stream"], "<= 20",
                           mem["kb_per_held_stream"] <= 20, " KB"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput cell")
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
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
