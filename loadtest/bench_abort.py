"""What a departing client costs: abort latency, undelivered tokens, queued drops, goodput.

    python -m loadtest.bench_abort                         # starts its own tether pair
    python -m loadtest.bench_abort --base-url http://127.0.0.1:8000 --model NAME \\
        --max-num-seqs 8                                   # any OpenAI-compatible server

Phases (one client at a time unless stated, so counter deltas belong to one request):
  calibrate full streams: seconds per decode step (the abort-latency budget is one of them),
            and how exactly SSE events count tokens (exact if the server sends token_ids;
            otherwise events are rescaled by usage/events and the figures are estimates)
  stream    open a stream, read k tokens, drop it; generated (server counter) - received
  nonstream a non-streaming request whose client times out; everything generated is waste
  queued    fill --max-num-seqs with long streams, queue more, drop the queued ones:
            their prompts must never be prefilled (prompt-token counter unchanged)
  churn     100 concurrent streams, half of them leave after a random number of tokens;
            goodput = tokens delivered / tokens generated; every --sample-every seconds the
            server's generated-token counter and the clients' delivered tokens are sampled
Abort latency: the server's histogram (proxy saw the disconnect -> session evicted), and the
client's view (socket closed -> running + waiting read 0 on /metrics, which also includes the
daemon's Stats cadence, ~0.1 s once it is idle).
Writes abort.json, abort_latency_cdf.png and churn_tokens.png (generated vs delivered over time)
under results/bench-abort-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from loadtest import sse_client
from loadtest.abort_report import plot_churn, plot_latency, report
from loadtest.abort_target import FAMILIES, Server, Tally, delta, read_stream
from loadtest.metrics import Histogram, Metrics
from loadtest.pair import raise_fd_limit, served_model, server_or_url
from loadtest.report import percentile, results_dir, summary, write_json

# --- phases ----------------------------------------------------------------------------------


async def phase_calibrate(srv: Server, streams: int = 3, tokens: int = 128) -> dict[str, Any]:
    """Full streams: seconds per decode step, and how exactly events count tokens.

    A server that sends ``token_ids`` per chunk is counted exactly. Otherwise one event counts
    as one token, which undercounts whenever a chunk carries several tokens (a detokenizer
    holding back part of a character); `accuracy` = usage tokens / counted tokens then
    rescales the counts of dropped streams, and the client-side figures are estimates.
    """
    ticks: list[float] = []
    counted = reported = 0
    for _ in range(streams):
        times: list[float] = []
        async with sse_client.stream(srv.base, "/v1/completions",
                                     srv.body(tokens, True)) as resp:
            got, usage = await read_stream(resp, None, times, srv)
        await srv.wait_idle()
        counted += got
        reported += usage or got
        if len(times) > 1 and usage:
            ticks.append((times[-1] - times[0]) / (usage - 1))
    # None when no stream gave two timed tokens (it ended at once, or arrived in one read):
    # a budget built on a tick of 0 would judge the latency against nothing.
    return {"tick_s": percentile(ticks, 0.5), "exact": srv.exact,
            "accuracy": reported / counted if counted else 1.0}


async def after_drop(srv: Server, before: Metrics | None, t_close: float,
                     latency: list[float], after_disconnect: list[float]) -> float | None:
    """Once the server is idle again: appends the client-view abort latency and the tokens
    generated after the disconnect; returns the tokens generated since `before`."""
    idle = await srv.wait_idle()
    after = srv.scrape()
    if idle is not None:
        latency.append(idle - t_close)
    late = delta(srv, before, after, "after")
    if late is not None:
        after_disconnect.append(late)
    return delta(srv, before, after, "gen")


async def phase_stream(srv: Server, trials: int, max_tokens: int,
                       accuracy: float) -> dict[str, Any]:
    """`accuracy` rescales event counts to tokens (1.0 when the server sends token_ids)."""
    waste: list[float] = []
    after_disconnect: list[float] = []
    latency: list[float] = []
    for _ in range(trials):
        before = srv.scrape()
        k = random.randint(1, 32)
        async with sse_client.stream(srv.base, "/v1/completions",
                                     srv.body(max_tokens, True)) as resp:
            received, _ = await read_stream(resp, k)
        assert resp.closed_at is not None
        gen = await after_drop(srv, before, resp.closed_at, latency, after_disconnect)
        if gen is not None:
            waste.append(gen - received * accuracy)
    return {"trials": trials, "waste_tokens": summary(waste),
            "server_tokens_after_disconnect": summary(after_disconnect),
            "client_abort_latency_s": summary(latency), "latency_samples_s": latency}


async def phase_nonstream(srv: Server, trials: int, max_tokens: int) -> dict[str, Any]:
    generated: list[float] = []
    after_disconnect: list[float] = []
    latency: list[float] = []
    for _ in range(trials):
        before = srv.scrape()
        timeout = random.uniform(0.05, 0.3)
        call = sse_client.call_json(srv.base, "POST", "/v1/completions",
                                    srv.body(max_tokens, False))
        try:
            await asyncio.wait_for(call, timeout)
        except TimeoutError:
            pass
        gen = await after_drop(srv, before, time.monotonic(), latency, after_disconnect)
        if gen is not None:
            generated.append(gen)
    return {"trials": trials, "generated_tokens_all_wasted": summary(generated),
            "server_tokens_after_disconnect": summary(after_disconnect),
            "client_abort_latency_s": summary(latency), "latency_samples_s": latency}


async def phase_queued(srv: Server, max_num_seqs: int | None, queued: int) -> dict[str, Any]:
    if max_num_seqs is None or not srv.names:
        return {"skipped": "needs --max-num-seqs and a server with metrics"}
    fillers = [await sse_client.request(srv.base, "POST", "/v1/completions",
                                        srv.body(1500, True)) for _ in range(max_num_seqs)]
    readers = [asyncio.create_task(read_stream(r, None)) for r in fillers]
    try:
        running = await srv.wait_for("running", max_num_seqs)
        # Every filler has decoded at least once, so its prefill is behind us.
        gen0 = srv.value(srv.scrape(), "gen") or 0.0
        await srv.wait_for("gen", gen0 + max_num_seqs)
        # Queued requests get no headers until they run: send without waiting for them.
        waiting_streams = [await sse_client.send(srv.base, "POST", "/v1/completions",
                                                 srv.body(64, True)) for _ in range(queued)]
        queued_seen = await srv.wait_for("waiting", queued)
        before = srv.scrape()
        for r in waiting_streams:
            r.close()
        t_close = time.monotonic()
        drained = None
        while time.monotonic() - t_close < 10:
            if (srv.value(srv.scrape(), "waiting") or 0.0) <= 0:
                drained = time.monotonic() - t_close
                break
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.3)
    finally:
        for r in fillers:
            r.close()
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    await srv.wait_idle()
    prefill = delta(srv, before, srv.scrape(), "prompt")
    return {"max_num_seqs": max_num_seqs, "queued": queued, "filled": running,
            "queue_seen": queued_seen, "prefill_tokens_of_dropped": prefill,
            "queued_abort_latency_s": drained}


async def sample_tokens(srv: Server, gen0: float | None, tally: Tally, accuracy: float,
                        every: float, stop: asyncio.Event) -> dict[str, Any]:
    """Cumulative generated (server counter) and delivered (clients) tokens over time, until
    `stop` is set, plus one last sample then."""
    t0 = time.monotonic()
    series: dict[str, Any] = {"every_s": every, "t_s": [], "generated": [], "delivered": []}
    while True:
        t, delivered = time.monotonic() - t0, tally.tokens * accuracy
        # Off the loop: the clients sharing it must not stall while /metrics is parsed.
        gen = srv.value(await asyncio.to_thread(srv.scrape), "gen")
        series["t_s"].append(round(t, 4))
        series["generated"].append(None if gen is None or gen0 is None else gen - gen0)
        series["delivered"].append(delivered)
        if stop.is_set():
            return series
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, t0 + t + every - time.monotonic()))


async def phase_churn(srv: Server, streams: int, seconds: float, churn: float,
                      accuracy: float, sample_every: float) -> dict[str, Any]:
    before = srv.scrape()
    totals = {"delivered_completed": 0, "delivered_dropped": 0, "counted_completed": 0,
              "completed": 0, "dropped": 0, "errors": 0}
    tally, stop = Tally(), asyncio.Event()
    sampler = asyncio.create_task(sample_tokens(srv, srv.value(before, "gen"), tally, accuracy,
                                                sample_every, stop))
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop_at:
            max_tokens = random.randint(16, 128)
            leave = random.randint(1, max_tokens - 1) if random.random() < churn else None
            try:
                async with sse_client.stream(srv.base, "/v1/completions",
                                             srv.body(max_tokens, True)) as resp:
                    got, usage = await read_stream(resp, leave, tally=tally)
            except (OSError, sse_client.HttpError, asyncio.IncompleteReadError):
                totals["errors"] += 1
                continue
            if leave is not None and usage is None:
                totals["dropped"] += 1
                totals["delivered_dropped"] += got
            else:
                totals["completed"] += 1
                totals["delivered_completed"] += usage if usage is not None else got
                totals["counted_completed"] += got

    try:
        await asyncio.gather(*(client() for _ in range(streams)))
        await srv.wait_idle(60)
    finally:
        stop.set()
        series = await sampler
    generated = delta(srv, before, srv.scrape(), "gen")
    delivered = totals["delivered_completed"] + totals["delivered_dropped"] * accuracy
    out: dict[str, Any] = {"streams": streams, "seconds": seconds, "churn": churn, **totals,
                           "generated": generated,
                           "goodput": delivered / generated if generated else None,
                           "series": series}
    if totals["counted_completed"]:
        # Usage tokens / counted tokens on streams that ran to the end, for comparison with
        # the calibration's figure.
        out["count_accuracy"] = totals["delivered_completed"] / totals["counted_completed"]
    return out


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    model = args.model or served_model(base) or "default"
    srv = Server(base, model)
    results: dict[str, Any] = {"server": base, "model": model,
                               "metrics": next((k for k, v in FAMILIES.items()
                                                if v == srv.names), None)}
    results["calibration"] = cal = await phase_calibrate(srv)
    results["tick_s"] = cal["tick_s"]
    accuracy = 1.0 if cal["exact"] else cal["accuracy"]
    # The server histogram per phase: the budget (one tick of a single stream) only applies
    # to the single-stream drops; under churn a tick carries 100 sequences.
    hists: dict[str, Histogram | None] = {}
    h0, t0 = _hist(srv), _hist(srv, "ticks")
    results["stream"] = await phase_stream(srv, args.trials, args.max_tokens, accuracy)
    h1, t1 = _hist(srv), _hist(srv, "ticks")
    hists["stream"] = h1.minus(h0) if h0 and h1 else None
    results["_ticks"] = ticks = t1.minus(t0) if t0 and t1 else None
    results["stream"]["server_abort_ticks_p99"] = ticks.bucket(0.99) if ticks else None
    results["nonstream"] = await phase_nonstream(srv, max(5, args.trials // 3), args.max_tokens)
    results["queued"] = await phase_queued(srv, args.max_num_seqs, args.queued)
    h2 = _hist(srv)
    results["churn"] = await phase_churn(srv, args.streams, args.churn_seconds, 0.5, accuracy,
                                         args.sample_every)
    h3 = _hist(srv)
    hists["churn"] = h3.minus(h2) if h2 and h3 else None
    for phase, hist in hists.items():
        results[phase]["server_abort_latency_s"] = None if hist is None else {
            "count": hist.count, "p50": hist.quantile(0.5), "p99": hist.quantile(0.99),
            "mean": hist.sum / hist.count if hist.count else None}
    results["_hist"] = hists["stream"]
    return results


def _hist(srv: Server, key: str = "latency") -> Histogram | None:
    m = srv.scrape()
    return m.histogram(srv.names[key]) if m and key in srv.names else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="server to test (default: our own pair)")
    parser.add_argument("--model", default=None, help="model name (default: /v1/models)")
    parser.add_argument("--serve-model", default="builtin:tiny", help="model our own pair loads")
    parser.add_argument("--serve-args", default="",
                        help="more flags for our own pair, e.g. '--device cuda --dtype bfloat16'")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the server's limit (our own pair: 16)")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--queued", type=int, default=4)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--churn-seconds", type=float, default=15.0)
    parser.add_argument("--sample-every", type=float, default=0.25,
                        help="seconds between churn samples of generated/delivered tokens")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not args.base_url and args.max_num_seqs is None:
        args.max_num_seqs = 16
    raise_fd_limit()
    out = results_dir(args.out, "bench-abort")
    with server_or_url(args.base_url, model=args.serve_model,
                       max_num_seqs=args.max_num_seqs,
                       extra_args=shlex.split(args.serve_args)) as (base, _pair):
        results = asyncio.run(run(args, base))
    hist, ticks = results.pop("_hist"), results.pop("_ticks")
    plot_latency(out / "abort_latency_cdf.png", results, hist)
    plot_churn(out / "churn_tokens.png", results["churn"], results["calibration"]["exact"])
    report(results, hist, ticks)
    write_json(out / "abort.json", results)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
