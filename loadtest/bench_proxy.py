"""The proxy's own cost per SSE event against a bare Starlette SSE app; proxy memory.

    python -m loadtest.bench_proxy [--seconds 4] [--levels 1,100,1000] [--held 1000]
                                   [--profile 10] [--out DIR]

In one run, on the same cores and with the same client:
  bare   a Starlette StreamingResponse on uvicorn, configured as the proxy's (loop and http
         "auto": uvloop + httptools when installed), yielding pre-made chat chunks
  tether `tether serve --model sim:0`: the simulated engine (no weights, ticks as fast as the
         daemon's Python allows), completions streams of 500 tokens with ignore_eos
at each of --levels concurrent streams (streams back to back; every SSE event counted, [DONE]
included): events/s, and from the processes' CPU times the CPU per event and the events per
CPU-second of the bare server and of the proxy (the daemon's CPU is shown beside). The
comparison is per CPU-second, not per wall second: client, proxy and daemon share the cores.
Then the proxy's RSS idle and with --held streams open, on a second pair (sim:50, 128
running, the rest queued in the daemon). With --profile S, py-spy samples the proxy for S
seconds under --profile-streams streams and the hottest functions are printed and saved.
Goals: proxy events per CPU-second >= 50% of the bare app's at 100 streams; <= 20 KB per held
stream. Writes proxy.json, throughput_vs_concurrency.png (and proxy.collapsed.txt, py-spy's
collapsed stacks, with --profile) under results/bench-proxy-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import psutil

from loadtest import sse_client
from loadtest.metrics import scrape
from loadtest.pair import REPO, ServerPair, free_port, health_ok, raise_fd_limit, served_model
from loadtest.report import goal_line, plot_lines, results_dir, write_json

BARE_EVENT = b"data: " + orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bare",
    "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                 "finish_reason": None}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"
GOAL_LEVEL = 100
GOAL_SHARE = 0.5
STREAM_TOKENS = 500
LINE_NUMBER = re.compile(r":\d+\)$")  # "func (file.py:12)" -> "func (file.py)"
SIM_ARGS = ("--max-tokens-per-tick", "2048", "--kv-cache-blocks", "40000")


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
    # The proxy's own server settings, so the difference is the proxy's code alone.
    uvicorn.run(app, host="127.0.0.1", port=port, loop="auto", http="auto", log_level="warning",
                access_log=False)


def start_bare() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.bench_proxy", "--serve-bare",
                             str(port)], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not health_ok(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the bare server did not start")
        time.sleep(0.1)
    return proc, url


# --- throughput ------------------------------------------------------------------------------


async def events_per_s(url: str, body: Callable[[], dict[str, Any]], streams: int,
                       seconds: float) -> dict[str, Any]:
    """`streams` clients, each issuing back-to-back streams until `seconds` have passed."""
    counts = {"events": 0, "requests": 0, "errors": 0, "short_streams": 0}
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    full = body()["max_tokens"] + 1  # every token's event, then [DONE]

    async def client() -> None:
        while time.monotonic() < deadline:
            try:
                async with sse_client.stream(url, "/v1/completions", body()) as resp:
                    got = await resp.count_events()
                counts["events"] += got
                counts["requests"] += 1
                counts["short_streams"] += got < full
            except (OSError, sse_client.HttpError, asyncio.IncompleteReadError) as e:
                counts["errors"] += 1
                if len(errors) < 5:
                    errors.append(repr(e)[:300])
                await asyncio.sleep(0.05)

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(streams)))
    elapsed = time.monotonic() - start
    return {**counts, "error_samples": errors, "seconds": elapsed,
            "events_per_s": counts["events"] / elapsed}


async def measured(url: str, model: str, streams: int, seconds: float,
                   procs: dict[str, psutil.Process]) -> dict[str, Any]:
    """One cell: throughput, and each process's CPU per event and events per CPU-second."""
    cpu0 = {name: cpu_s(p) for name, p in procs.items()}
    writes0 = {name: writes(p) for name, p in procs.items()}
    cell = await events_per_s(url, body_maker(model, STREAM_TOKENS), streams, seconds)
    events = max(1, cell["events"])
    for name, p in procs.items():
        used = cpu_s(p) - cpu0[name]
        cell[f"{name}_cpu_s"] = used
        cell[f"{name}_cpu_us_per_event"] = used * 1e6 / events
        cell[f"{name}_events_per_cpu_s"] = events / used if used else None
        # write(2) calls per event: how many events each socket write carries.
        cell[f"{name}_writes_per_event"] = (writes(p) - writes0[name]) / events
    return cell


def body_maker(model: str, tokens: int) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {"model": model, "prompt": "hi", "max_tokens": tokens, "ignore_eos": True,
                "stream": True}
    return make


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def writes(proc: psutil.Process) -> int:
    return int(proc.io_counters().write_count)


def rss_kb(proc: psutil.Process) -> float:
    return float(proc.memory_info().rss) / 1024


# --- memory ----------------------------------------------------------------------------------


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


# --- profile ---------------------------------------------------------------------------------


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def profile_proxy(url: str, model: str, proxy: psutil.Process, streams: int,
                        seconds: float, out: Path) -> dict[str, Any]:
    """py-spy on the proxy while `streams` streams run; the hottest functions, by share."""
    spy = find_py_spy()
    if spy is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    raw = out / "proxy.collapsed.txt"
    cmd = [spy, "record", "-p", str(proxy.pid), "-d", str(int(seconds)), "-r", "200",
           "-f", "raw", "-o", str(raw), "--nonblocking"]
    spy_proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
    load = asyncio.create_task(events_per_s(url, body_maker(model, STREAM_TOKENS), streams,
                                            seconds + 2))
    _, err = await spy_proc.communicate()
    await load
    if spy_proc.returncode or not raw.exists():
        return {"error": f"py-spy failed: {err.decode(errors='replace')[-500:]}"}
    return summarise_stacks(raw.read_text())


def summarise_stacks(collapsed: str, top: int = 25) -> dict[str, Any]:
    """Inclusive and self shares per function ("name (file)") from py-spy's collapsed stacks."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [LINE_NUMBER.sub(")", frame) for frame in stack.split(";")]
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
        own[frames[-1]] += int(count)

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(n / total, 4)) for f, n in counter.most_common()][:top] if total else []

    # tether's own functions, below the entry point that every sample shares.
    ours = collections.Counter({f: n for f, n in inclusive.items()
                                if ("(proxy/" in f or "(ipc/" in f) and n < 0.9 * total})
    return {"samples": total, "inclusive": shares(ours), "self": shares(own)}


# --- driver ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace, bare: subprocess.Popen[bytes], bare_url: str,
              pair: ServerPair, out: Path) -> dict[str, Any]:
    model = served_model(pair.base_url) or "default"
    res: dict[str, Any] = {"model": model, "seconds": args.seconds, "levels": args.levels,
                           "stream_tokens": STREAM_TOKENS}
    procs = pair.processes()
    bare_procs = {"bare": psutil.Process(bare.pid)}
    for streams in args.levels:
        res[f"bare_{streams}"] = await measured(bare_url, "bare", streams, args.seconds,
                                                bare_procs)
        res[f"tether_{streams}"] = await measured(pair.base_url, model, streams, args.seconds,
                                                  procs)
        await asyncio.sleep(0.5)
    if args.profile:
        res["profile"] = await profile_proxy(pair.base_url, model, procs["proxy"],
                                             args.profile_streams, args.profile, out)
    return res


def share_of_bare(res: dict[str, Any], streams: int) -> float | None:
    ours = res[f"tether_{streams}"]["proxy_events_per_cpu_s"]
    bare = res[f"bare_{streams}"]["bare_events_per_cpu_s"]
    return ours / bare if ours and bare else None


def report(res: dict[str, Any]) -> None:
    print(f"\n=== proxy benchmark (model {res['model']}, {res['seconds']:g} s per cell, "
          f"{res['stream_tokens']}-token streams) ===")
    print(f"  {'streams':>8} {'ev/s bare':>10} {'tether':>7} {'us/ev bare':>11} {'proxy':>6} "
          f"{'daemon':>7} {'ev/CPU-s bare':>14} {'proxy':>7} {'share':>6} "
          f"{'writes/ev bare':>15} {'proxy':>6}")
    for streams in res["levels"]:
        bare, ours = res[f"bare_{streams}"], res[f"tether_{streams}"]
        share = share_of_bare(res, streams)
        print(f"  {streams:>8} {bare['events_per_s']:>10.0f} {ours['events_per_s']:>7.0f} "
              f"{bare['bare_cpu_us_per_event']:>11.1f} {ours['proxy_cpu_us_per_event']:>6.1f} "
              f"{ours['daemon_cpu_us_per_event']:>7.1f} {bare['bare_events_per_cpu_s'] or 0:>14.0f} "
              f"{ours['proxy_events_per_cpu_s'] or 0:>7.0f} {share or 0:>6.0%} "
              f"{bare['bare_writes_per_event']:>15.2f} {ours['proxy_writes_per_event']:>6.2f}")
    if GOAL_LEVEL in res["levels"]:
        share = share_of_bare(res, GOAL_LEVEL)
        print(goal_line(f"proxy / bare events per CPU-s, {GOAL_LEVEL} streams", share,
                        f">= {GOAL_SHARE:.0%}", None if share is None
                        else share >= GOAL_SHARE))
    mem = res.get("memory")
    if mem:
        print(f"  proxy RSS idle {mem['rss_idle_kb'] / 1024:.1f} MiB, with "
              f"{mem['proxy_sessions_seen']:.0f} held streams {mem['rss_held_kb'] / 1024:.1f} "
              f"MiB, after release {mem['rss_after_release_kb'] / 1024:.1f} MiB")
        print(goal_line("KB per held stream", mem["kb_per_held_stream"], "<= 20",
                        mem["kb_per_held_stream"] <= 20, " KB"))
    prof = res.get("profile")
    if prof:
        print(f"  proxy profile ({prof.get('samples', 0)} samples on CPU)"
              + (f": {prof['error']}" if "error" in prof else ""))
        for title, key in (("inclusive, tether's own functions", "inclusive"),
                           ("self", "self")):
            print(f"   {title}:")
            for frame, share in prof.get(key, [])[:15]:
                print(f"    {share:>6.1%}  {frame}")


def plot(path: Path, res: dict[str, Any]) -> Path:
    levels = res["levels"]
    series = {"bare (per CPU-s)": [res[f"bare_{n}"]["bare_events_per_cpu_s"] or 0
                                   for n in levels],
              "proxy (per CPU-s)": [res[f"tether_{n}"]["proxy_events_per_cpu_s"] or 0
                                    for n in levels]}
    return plot_lines(path, levels, series, "concurrent streams",
                      "SSE events per CPU-second",
                      f"Proxy cost vs a bare Starlette app (model {res['model']})",
                      logx=True, logy=True, marker="o")


def levels_arg(text: str) -> list[int]:
    levels = sorted({int(v) for v in text.split(",") if v.strip()})
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("want comma-separated stream counts >= 1")
    return levels


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    with ServerPair(model="sim:50", max_num_seqs=128, extra_args=SIM_ARGS) as pair:
        model = served_model(pair.base_url) or "default"

        def metric(name: str) -> float:
            return scrape(pair.base_url).total(name)

        return asyncio.run(held_streams_rss(pair.base_url, model, pair.processes()["proxy"],
                                            args.held, metric))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput cell")
    parser.add_argument("--levels", type=levels_arg, default=[1, 100, 1000],
                        help="concurrent streams per cell, comma-separated")
    parser.add_argument("--model", default="sim:0", help="what the tether pair serves")
    parser.add_argument("--held", type=int, default=1000, help="0 skips the memory phase")
    parser.add_argument("--profile", type=float, default=0.0,
                        help="seconds of py-spy sampling of the proxy (0: none)")
    parser.add_argument("--profile-streams", type=int, default=100)
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve-bare", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare is not None:
        serve_bare(args.serve_bare)
        return 0
    raise_fd_limit(4 * max(args.held, *args.levels) + 1024)
    out = results_dir(args.out, "bench-proxy")
    bare, bare_url = start_bare()
    max_seqs = max(128, *args.levels)
    extra = SIM_ARGS if args.model.startswith("sim:") else ()
    try:
        with ServerPair(model=args.model, max_num_seqs=max_seqs,
                        extra_args=extra) as pair:
            res = asyncio.run(run(args, bare, bare_url, pair, out))
    finally:
        bare.terminate()
        bare.wait(10)
    if args.held:
        res["memory"] = measure_memory(args)
    report(res)
    write_json(out / "proxy.json", res)
    plot(out / "throughput_vs_concurrency.png", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
