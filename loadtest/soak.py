"""Soak: a long locust run with heavy churn while the pair's memory is watched.

    python -m loadtest.soak                          # 10 min, 200 users, 50% churn
    python -m loadtest.soak --duration 1800 --users 300 --warmup 120

Starts a fresh pair, runs the locust load test (loadtest/locustfile.py, with its own
settle / 5xx / waste checks) and, beside it, misbehaving clients (loadtest/faults.py: one that
never reads, one that leaves during a 3 MB upload, a 2,000-token prefill; --no-faults to leave
them out), and samples the RSS of the proxy and the daemon every --sample-every seconds.
Fails (exit 1) if either process's RSS at the end (median of the last three samples) exceeds its
RSS just after --warmup (median of the first three samples past it) by more than --max-growth,
if the locust run failed, if a misbehaving client's request was answered 5xx, or if the daemon
counted any proxy_lost abort (the pipes must never break).
With --hostile the hostile clients of loadtest/hostile.py join them (big replies, nested
bodies, idle and trickling sockets, huge heads, one enormous request every 30 s), with the pair
under a 1024-descriptor limit (--fd-limit; what systemd gives a unit without LimitNOFILE): it
also fails if a hostile client met a 5xx, and, given --baseline (the soak.json of a quiet run),
if the well-behaved streams' p99 TTFT is over twice the baseline's.
Writes soak.json, rss.png and the locust report under results/soak-<timestamp>/ (or --out).

    python -m loadtest.soak --duration 90 --users 20 --warmup 30   # a short check
    python -m loadtest.soak --no-faults --out results/soak-quiet
    python -m loadtest.soak --hostile --baseline results/soak-quiet/soak.json
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from loadtest import run_locust
from loadtest.faults import FaultClients
from loadtest.hostile import HostileClients
from loadtest.metrics import scrape
from loadtest.pair import REPO, ServerPair, raise_fd_limit
from loadtest.report import goal_line, plot_lines, results_dir, write_json

# The misbehaving clients stop this long before the load does, so the end checks see quiet.
FAULTS_STOP_BEFORE_S = 20.0


def sample_until_exit(proc: subprocess.Popen[bytes], procs: dict[str, psutil.Process],
                      every: float, faults: FaultClients | None, faults_until: float,
                      ) -> tuple[list[float], dict[str, list[float]], dict[str, int]]:
    start = time.monotonic()
    times: list[float] = []
    rss: dict[str, list[float]] = {name: [] for name in procs}
    fault_counts: dict[str, int] = {}
    while proc.poll() is None:
        if faults is not None and time.monotonic() - start >= faults_until:
            fault_counts, faults = faults.stop(), None
        times.append(time.monotonic() - start)
        for name, p in procs.items():
            try:
                rss[name].append(p.memory_info().rss / 2**20)
            except psutil.Error:
                rss[name].append(float("nan"))
        try:
            proc.wait(every)
        except subprocess.TimeoutExpired:
            pass
    if faults is not None:
        fault_counts = faults.stop()
    return times, rss, fault_counts


def ttft_p99_ms(out: Path) -> float | None:
    """The well-behaved clients' p99 time to first token, from locust's statistics: the worst
    of its kinds (completions, chat streams, conversations)."""
    try:
        with open(out / "locust_stats.csv", newline="") as f:
            p99s = [float(row["99%"]) for row in csv.DictReader(f)
                    if row["Type"] == "METRIC" and row["Name"].startswith("ttft_ms")]
    except (OSError, KeyError, ValueError):
        return None
    return max(p99s) if p99s else None


def ttft_p99_ms_of(soak_json: Path) -> float | None:
    value = json.loads(soak_json.read_text()).get("ttft_p99_ms")
    return None if value is None else float(value)


def growth(times: list[float], values: list[float], warmup: float) -> dict[str, Any]:
    after = [v for t, v in zip(times, values, strict=True) if t >= warmup]
    if len(after) < 4:
        return {"warm_mib": None, "end_mib": None, "growth": None,
                "note": "too few samples after warm-up"}
    warm, end = statistics.median(after[:3]), statistics.median(after[-3:])
    return {"warm_mib": warm, "end_mib": end, "growth": end / warm - 1.0,
            "peak_mib": max(values)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--churn", type=float, default=0.5)
    parser.add_argument("--warmup", type=float, default=180.0,
                        help="seconds before the baseline (the allocator grows to its peak batch first)")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-tokens-per-tick", type=int, default=None,
                        help="the pair's tick budget (2048: the 2k prefill is one long tick)")
    parser.add_argument("--no-faults", dest="faults", action="store_false",
                        help="leave out the misbehaving clients")
    parser.add_argument("--hostile", action="store_true",
                        help="add the hostile clients (loadtest/hostile.py)")
    parser.add_argument("--fd-limit", type=int, default=None,
                        help="the pair's open-files limit (default: 1024 with --hostile)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="soak.json of a quiet run: p99 TTFT must stay within 2x of its")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = results_dir(args.out, "soak")
    raise_fd_limit()

    extra = [] if args.max_tokens_per_tick is None else [
        "--max-tokens-per-tick", str(args.max_tokens_per_tick)]
    fd_limit = args.fd_limit or (1024 if args.hostile else None)
    with ServerPair(model=args.model, max_num_seqs=args.max_num_seqs,
                    extra_args=extra, fd_limit=fd_limit) as pair:
        procs = pair.processes()
        cmd = run_locust.locust_command(pair.base_url, args.duration, args.users,
                                        max(1.0, args.users / 10), out, None,
                                        ["--lt-churn", str(args.churn)])
        print("$", " ".join(cmd), flush=True)
        locust = subprocess.Popen(cmd, cwd=REPO)
        faults = FaultClients(pair.base_url).start() if args.faults else None
        hostile = HostileClients(pair.base_url).start() if args.hostile else None
        times, rss, fault_counts = sample_until_exit(
            locust, procs, args.sample_every, faults,
            max(args.duration - FAULTS_STOP_BEFORE_S, args.duration / 2))
        hostile_counts = hostile.stop() if hostile is not None else {}
        pids = {name: p.pid for name, p in procs.items()}
        aborts = scrape(pair.base_url).by_label("tether_aborts_total", "cause")

    verdicts = {name: growth(times, values, args.warmup) for name, values in rss.items()}
    problems = [f"{name} RSS grew {v['growth']:.1%} after warm-up "
                f"({v['warm_mib']:.1f} -> {v['end_mib']:.1f} MiB)"
                for name, v in verdicts.items()
                if v["growth"] is not None and v["growth"] > args.max_growth]
    if locust.returncode != 0:
        problems.append(f"locust exited with {locust.returncode} (see its checks above)")
    if any(v["growth"] is None for v in verdicts.values()):
        problems.append("not enough samples after warm-up to judge memory growth")
    if fault_counts.get("prefill_5xx"):
        problems.append(f"{fault_counts['prefill_5xx']} of the 2k-token prefills answered 5xx")
    if aborts.get("proxy_lost"):
        problems.append(f"{aborts['proxy_lost']:.0f} proxy_lost aborts: the pipes broke")
    if hostile_counts.get("5xx"):
        problems.append(f"{hostile_counts['5xx']} hostile requests answered 5xx")
    p99 = ttft_p99_ms(out)
    base_p99 = ttft_p99_ms_of(args.baseline) if args.baseline is not None else None
    if p99 is not None and base_p99 is not None and p99 > 2 * base_p99:
        problems.append(f"p99 TTFT {p99:.0f} ms, over twice the quiet run's {base_p99:.0f} ms")

    print(f"\n=== soak ({args.duration:g} s, {args.users} users, churn {args.churn:g}) ===")
    for name, v in verdicts.items():
        print(goal_line(f"{name} RSS growth after warm-up", v["growth"],
                        f"<= {args.max_growth:.0%}",
                        None if v["growth"] is None else v["growth"] <= args.max_growth))
    print(f"  misbehaving clients: {fault_counts or 'none'}")
    print(f"  hostile clients: {hostile_counts or 'none'}")
    print(f"  p99 TTFT, worst kind: {p99} ms" + (f" (quiet run: {base_p99} ms)"
                                                     if base_p99 is not None else ""))
    print(f"  aborts by cause: {aborts}")
    for problem in problems:
        print("  FAIL:", problem)
    write_json(out / "soak.json", {"args": vars(args), "pids": pids, "times_s": times,
                                   "rss_mib": rss, "growth": verdicts,
                                   "faults": fault_counts, "hostile": hostile_counts,
                                   "fd_limit": fd_limit, "ttft_p99_ms": p99,
                                   "baseline_ttft_p99_ms": base_p99, "aborts": aborts,
                                   "locust_exit": locust.returncode,
                                   "problems": problems})
    plot_lines(out / "rss.png", times, rss, "seconds", "RSS (MiB)",
               "tether RSS during the soak")
    print(f"  result: {'FAIL' if problems else 'PASS'}; results in {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
