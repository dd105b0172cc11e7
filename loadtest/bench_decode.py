"""The decode tick of the SmolLM-135M-shaped checkpoint in process (no HTTP), this checkout
against another, interleaved.

    python -m loadtest.bench_decode [--against DIR] [--levels 1,8,32,64] [--reps 3]
                                    [--ticks 16] [--threads 2] [--out DIR]

Each checkout runs loadtest/decode_ticks.py in its own process (its daemon/ first on
PYTHONPATH: its engine, runner and CPU kernels) on `loadtest/checkpoint.py`'s checkpoint; rep
by rep, level by level, the two take turns, the order alternating. Medians over the reps of
each rep's median tick, the forward pass inside it and streams / tick as tokens/s. Writes
decode.json under results/bench-decode-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from loadtest.bench_host import levels_arg, run_engine
from loadtest.checkpoint import ensure_checkpoint
from loadtest.pair import REPO
from loadtest.report import results_dir, write_json

SCRIPT = Path(__file__).with_name("decode_ticks.py")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=levels_arg, default=[1, 8, 32, 64])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ticks", type=int, default=16, help="timed ticks per rep")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout, measured interleaved with this one")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    trees = {"this": REPO, **({} if args.against is None else {"against": args.against.resolve()})}
    res: dict[str, Any] = {"levels": args.levels, "reps": args.reps, "ticks": args.ticks,
                           "threads": args.threads, "trees": {n: str(p) for n, p in trees.items()},
                           "load_average": [round(x, 2) for x in psutil.getloadavg()]}
    res["decode"] = run_engine(trees, args.levels, args.reps, args.ticks, SCRIPT,
                               [str(ensure_checkpoint()), str(max(args.levels)),
                                str(args.threads)])
    print(f"\n=== decode tick in process, medians of {args.reps} interleaved reps: "
          "tick ms, forward ms, tok/s (" + " | ".join(trees) + ") ===")
    for level in args.levels:
        cells = [res["decode"][n][str(level)] for n in trees]
        print(f"  {level:>4} streams: " + " | ".join(
            f"{c['tick_us'] / 1e3:7.1f} {c['forward_us'] / 1e3:7.1f} {c['tok_per_s']:6.0f}"
            for c in cells))
    out = results_dir(args.out, "bench-decode")
    write_json(out / "decode.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
