"""The abort benchmark's figures against their goals, printed, and its two plots: the abort
latency CDF and the tokens generated against those delivered under churn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.metrics import Histogram
from loadtest.report import goal_line, plot_cdf, plot_lines

ANCHORS = (
    "vLLM and SGLang finish the step in flight on an abort (SGLang runs one more decode);",
    "SGLang polls non-streaming clients every 4 s, llama.cpp every 1 s (never while busy).",
)


def report(results: dict[str, Any], latency_hist: Histogram | None,
           ticks: Histogram | None) -> None:
    tick = results["tick_s"]
    budget = None if tick is None else tick + 0.002
    stream, queued, churn = results["stream"], results["queued"], results["churn"]
    waste_p99 = stream["waste_tokens"]["p99"]
    server_p99 = latency_hist.quantile(0.99) if latency_hist else None
    client_p99 = stream["client_abort_latency_s"]["p99"]
    prefill = queued.get("prefill_tokens_of_dropped")
    goodput = churn["goodput"]
    print(f"\n=== abort benchmark ({results['server']}, model {results['model']}) ===")
    cal = results["calibration"]
    exact = cal["exact"]
    shown = "not measured" if tick is None else f"{tick * 1000:.2f} ms"
    print(f"  tick (one stream) {shown}; client token counts "
          + ("exact (token_ids)" if exact else
             f"ESTIMATED: events x {cal['accuracy']:.2f} (server sends no token_ids)"))
    print(goal_line("waste per dropped stream, p99 (tokens)", waste_p99, "<= 1",
                    None if waste_p99 is None or not exact else waste_p99 <= 1))
    late_p99 = stream["server_tokens_after_disconnect"]["p99"]
    print(goal_line("  server: tokens after disconnect, p99", late_p99, "<= 1",
                    None if late_p99 is None else late_p99 <= 1))
    # A histogram knows the bucket, not the value: the verdict is only given when the whole
    # bucket holding p99 is on one side of the budget.
    bounds = latency_hist.bucket(0.99) if latency_hist else None
    verdict = None if bounds is None or budget is None else (
        True if bounds[1] <= budget else False if bounds[0] >= budget else None)
    where = "" if bounds is None else f" (bucket {bounds[0] * 1e3:g}-{bounds[1] * 1e3:g} ms)"
    print(goal_line("abort latency p99, server (stream drops)",
                    server_p99 and server_p99 * 1e3,
                    "<= tick + 2 ms" if budget is None else f"<= {budget * 1e3:.2f} ms{where}",
                    verdict, " ms"))
    ticks_bounds = ticks.bucket(0.99) if ticks else None
    ticks_p99 = None if ticks_bounds is None else ticks_bounds[1]
    print(goal_line("  ticks started before the eviction, p99", ticks_p99, "<= 1",
                    None if ticks_p99 is None else ticks_p99 <= 1))
    print(goal_line("abort latency p99, client view (idle seen)",
                    client_p99 and client_p99 * 1e3, "(upper bound)", None, " ms"))
    churn_lat = (churn.get("server_abort_latency_s") or {}).get("p99")
    print(goal_line(f"abort latency p99, server ({churn['streams']}-stream churn)",
                    churn_lat and churn_lat * 1e3, "(info)", None, " ms"))
    print(goal_line("prefill tokens of dropped queued requests", prefill, "== 0",
                    None if prefill is None else prefill == 0))
    print(goal_line(f"goodput, {churn['churn']:.0%} churn, {churn['streams']} streams"
                    + ("" if exact else " (est.)"),
                    goodput, ">= 0.99",
                    None if goodput is None else goodput >= 0.99))
    ns = results["nonstream"]
    print(f"  non-streaming drop: generated {ns['generated_tokens_all_wasted']['mean']} tokens "
          f"(mean), after disconnect {ns['server_tokens_after_disconnect']['mean']}, idle after "
          f"{_ms(ns['client_abort_latency_s']['p50'])} (p50)")
    print("  anchors: " + "\n           ".join(ANCHORS))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def plot_latency(path: Path, results: dict[str, Any], hist: Histogram | None) -> None:
    series = {"stream drop (client view)": results["stream"]["latency_samples_s"],
              "non-stream drop (client view)": results["nonstream"]["latency_samples_s"]}
    series = {k: [v * 1000 for v in vs] for k, vs in series.items()}
    points = {}
    if hist is not None and hist.count:
        points["server histogram (bucket bounds)"] = [
            (le * 1000, c / hist.count) for le, c in hist.buckets if le != float("inf")]
    plot_cdf(path, series, "abort latency (ms)", "Abort latency CDF", points)


def plot_churn(path: Path, churn: dict[str, Any], exact: bool) -> Path | None:
    series = churn["series"]
    if any(g is None for g in series["generated"]):
        return None  # no generation counter on this server
    goodput, generated = churn["goodput"], churn["generated"]
    shown = "n/a" if goodput is None else f"{goodput:.3f}"
    if goodput is not None and generated:
        shown += f", {generated * (1 - goodput):.0f} of {generated:.0f} tokens undelivered"
    return plot_lines(
        path, series["t_s"],
        {"generated (server counter)": series["generated"],
         "delivered (clients" + (", token_ids)" if exact else ", estimated)"):
             series["delivered"]},
        "seconds since the churn phase started", "tokens (cumulative)",
        f"Tokens generated vs delivered under churn\n{churn['streams']} streams, "
        f"{churn['churn']:.0%} leave; goodput {shown}")
