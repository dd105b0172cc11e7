"""Host cost per sequence per tick on `sim:0`: the daemon's engine alone, and the whole stack.

    python -m loadtest.bench_host [--levels 1,16,64,256] [--reps 5] [--ticks 100]
                                  [--against DIR ...] [--stack-reps 2] [--no-stack] [--out DIR]

sim:0 has no weights, so what a tick costs is the host's work around the forward pass:
  engine  in process (loadtest/host_ticks.py, one process per checkout): the engine built as
          `tether daemon --model sim:0` builds it, N completions of 256 tokens (ignore_eos,
          temperature 1) admitted, then --ticks decode ticks timed once all N decode; the
          median tick, and it divided by N: µs per sequence per tick
  stack   a real pair (`tether serve --model sim:0`), N streaming HTTP clients of 256 tokens
          each: the daemon's CPU time per tick (psutil, /metrics' tick counter) and tokens/s
With --against DIR the same is measured for the checkout at DIR (its daemon/ and ipc/ first on
PYTHONPATH), interleaved with this one rep by rep, the order alternating, so that both see the
same machine; medians over the reps. --against may be given more than once. Goal (issue 24):
<= 8 µs per sequence per tick in the daemon. Writes host.json under
results/bench-host-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from ipc.stats import Phase
from loadtest import sse_client
from loadtest.bench_proxy import cpu_s
from loadtest.metrics import scrape
from loadtest.pair import REPO, ServerPair, raise_fd_limit, served_model
from loadtest.report import goal_line, results_dir, write_json

WORKER = Path(__file__).with_name("host_ticks.py")
GOAL_US = 8.0
STREAM_TOKENS = 256


class Worker:
    """A measuring script (host_ticks.py by default) in its own process, on one checkout: each
    `ask` writes one JSON line to it and reads its one line of figures back."""

    def __init__(self, repo: Path, script: Path = WORKER, args: Sequence[str] = ()) -> None:
        env = dict(os.environ)
        # The checkout first; what the path held after it (wheels installed beside, as on the
        # device machine).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        self.name = script.name
        self.proc = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=repo, text=True)

    def ask(self, **fields: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(fields) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def alternating(names: list[str], rep: int) -> list[str]:
    """Every other rep the other order, so that neither side always runs first."""
    return names if rep % 2 == 0 else names[::-1]


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    lists = [k for k, v in runs[0].items() if isinstance(v, list)]  # of floats, item by item
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in keys},
            **{k: [statistics.median(items) for items in zip(*(r[k] for r in runs), strict=True)]
               for k in lists}, "reps": len(runs)}


def run_engine(trees: dict[str, Path], levels: list[int], reps: int, ticks: int,
               script: Path = WORKER, args: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Each tree's `script` asked for every level, rep by rep, the order alternating."""
    workers = {name: Worker(path, script, args) for name, path in trees.items()}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {n: {lv: [] for lv in levels}
                                                        for n in trees}
    try:
        for rep in range(reps):
            for level in levels:
                for name in alternating(list(trees), rep):
                    runs[name][level].append(workers[name].ask(streams=level, ticks=ticks))
            print(f"  {script.stem} rep {rep + 1}/{reps} done", flush=True)
    finally:
        for w in workers.values():
            w.close()
    return {n: {str(lv): medians(r) for lv, r in by.items()} for n, by in runs.items()}


# --- the whole stack -------------------------------------------------------------------------


async def stream_all(url: str, model: str, streams: int) -> int:
    """`streams` streaming completions at once; the SSE events they got."""
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "stream": True}

    async def one() -> int:
        async with sse_client.stream(url, "/v1/completions", body) as resp:
            return await resp.count_events()

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


def stack_cell(pair: ServerPair, model: str, streams: int) -> dict[str, Any]:
    daemon = pair.processes()["daemon"]
    before, cpu0, t0 = scrape(pair.base_url), cpu_s(daemon), time.perf_counter()
    events = asyncio.run(stream_all(pair.base_url, model, streams))
    wall, cpu, after = time.perf_counter() - t0, cpu_s(daemon) - cpu0, scrape(pair.base_url)
    ticks = after.total("tether_engine_ticks_total") - before.total("tether_engine_ticks_total")
    tokens = (after.total("tether_generation_tokens_total")
              - before.total("tether_generation_tokens_total"))
    per_tick = cpu / ticks * 1e6 if ticks else float("nan")
    return {"streams": streams, "wall_s": wall, "events": events, "ticks": ticks,
            "tokens": tokens, "tok_per_s": tokens / wall, "daemon_cpu_s": cpu,
            "daemon_cpu_tick_us": per_tick, "daemon_cpu_us_per_seq": per_tick / streams}


def run_stack(trees: dict[str, Path], levels: list[int], reps: int) -> dict[str, dict[str, Any]]:
    raise_fd_limit()
    most = max(levels)
    args = ["--kv-cache-blocks", str(most * 24 + 64), "--max-tokens-per-tick",
            str(max(512, 2 * most))]
    pairs: dict[str, ServerPair] = {}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {n: {lv: [] for lv in levels}
                                                        for n in trees}
    try:
        for name, path in trees.items():
            pairs[name] = ServerPair("sim:0", most, args, repo=path).start()
        models = {n: served_model(p.base_url) or "sim:0" for n, p in pairs.items()}
        for name, pair in pairs.items():
            stack_cell(pair, models[name], 4)  # warm-up
        for rep in range(reps):
            for level in levels:
                for name in alternating(list(trees), rep):
                    runs[name][level].append(stack_cell(pairs[name], models[name], level))
            print(f"  stack rep {rep + 1}/{reps} done", flush=True)
    finally:
        for pair in pairs.values():
            pair.stop()
    return {n: {str(lv): medians(r) for lv, r in by.items()} for n, by in runs.items()}


# --- report ----------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> None:
    names = list(res["trees"])
    print(f"\n=== host cost per tick on sim:0 (medians of {res['reps']} interleaved reps; "
          f"load average {res['load_average']}) ===")
    print("  engine in process: µs per tick, µs per sequence per tick   ("
          + " | ".join(names) + ")")
    for level in res["levels"]:
        cells = [res["engine"][n][str(level)] for n in names]
        print(f"    {level:>4} streams: " + " | ".join(
            f"{c['tick_us']:9.1f} {c['us_per_seq']:7.2f}" for c in cells))
    report_phases(res)
    if "stack" in res:
        print("  whole stack: daemon CPU µs per tick, per sequence per tick, tokens/s   ("
              + " | ".join(names) + ")")
        for level in res["levels"]:
            cells = [res["stack"][n][str(level)] for n in names]
            print(f"    {level:>4} streams: " + " | ".join(
                f"{c['daemon_cpu_tick_us']:9.1f} {c['daemon_cpu_us_per_seq']:7.2f} "
                f"{c['tok_per_s']:8.0f}" for c in cells))
    top = str(max(res["levels"]))
    ours = res["engine"]["this"][top]["us_per_seq"]
    print(goal_line(f"engine µs per sequence per tick, {top} streams", ours, f"<= {GOAL_US}",
                    ours <= GOAL_US))


def report_phases(res: dict[str, Any]) -> None:
    """The engine's own time per phase of its step (a mean per tick), where a tree has them."""
    for name in res["trees"]:
        cells = res["engine"][name]
        if not all(c.get("phase_us") for c in cells.values()):
            continue  # a tree before the step's phases
        print(f"  {name}: engine µs per tick by phase (" + " / ".join(Phase) + ")")
        for level in res["levels"]:
            print(f"    {level:>4} streams: "
                  + " / ".join(f"{t:.1f}" for t in cells[str(level)]["phase_us"]))


def levels_arg(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are positive integers, e.g. 1,16,64,256")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=levels_arg, default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=5, help="interleaved engine reps")
    parser.add_argument("--ticks", type=int, default=100, help="timed ticks per engine rep")
    parser.add_argument("--against", type=Path, action="append", default=[],
                        help="another checkout, measured interleaved with this one "
                             "(repeat it for more: each is named by its directory)")
    parser.add_argument("--stack-reps", type=int, default=2)
    parser.add_argument("--no-stack", action="store_true", help="the engine alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    trees = {"this": REPO}
    for path in args.against:
        name = path.resolve().name
        trees[name if name not in trees else f"{name}-{len(trees)}"] = path.resolve()
    out = results_dir(args.out, "bench-host")
    res: dict[str, Any] = {"levels": args.levels, "reps": args.reps, "ticks": args.ticks,
                           "trees": {n: str(p) for n, p in trees.items()},
                           "load_average": [round(x, 2) for x in psutil.getloadavg()]}
    res["engine"] = run_engine(trees, args.levels, args.reps, args.ticks)
    if not args.no_stack:
        res["stack"] = run_stack(trees, args.levels, args.stack_reps)
    report(res)
    write_json(out / "host.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
