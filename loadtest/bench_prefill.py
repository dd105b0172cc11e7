"""Cold prefill: time to first token of a long prompt nothing in the cache shares.

    python -m loadtest.bench_prefill [--against DIR] [--tokens 1516] [--reps 3] [--no-stack]

Two figures, each the best of --reps fresh random prompts of --tokens byte tokens on the
SmolLM-135M-shaped fp32 checkpoint (written once to --model-dir, as bench_engine.py does):
  engine  the model runner in process (loadtest/prefill_ticks.py), the prompt in chunks of
          --chunk tokens as the scheduler cuts it, from the first chunk to the last's logits
  stack   `tether serve --threads T` over HTTP: a completion of one token, sent to answer
With --against DIR the same is measured for the checkout at DIR (its daemon/ first on
PYTHONPATH), interleaved with this one rep by rep, the order alternating. Goal (issue 24):
<= 0.8x vLLM 0.32 CPU's TTFT on the same prompt and threads, 4.24 s measured on an AVX2 host
(../shared/notes/peers.md), so <= 3.39 s there; vLLM's figure moves with the host (2.39 s on
an AVX-512 one), so the goal line is only a pointer: bench_vs_vllm.py measures both in one run.
Writes prefill.json under results/bench-prefill-*/.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import sse_client
from loadtest.bench_host import Worker, alternating
from loadtest.checkpoint import SMOLLM_135M_DIR, ensure_checkpoint
from loadtest.pair import REPO, ServerPair, served_model
from loadtest.report import goal_line, results_dir, write_json

WORKER = Path(__file__).with_name("prefill_ticks.py")
VLLM_TTFT_S = 4.24  # vLLM 0.32 CPU, same checkpoint and prompt length, both cores, AVX2 host
GOAL = 0.8


def cold_request(base: str, model: str, tokens: int, rng: random.Random) -> float:
    """Seconds to the answer of a one-token completion of a fresh prompt (one byte a token)."""
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(tokens))
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    status, out = asyncio.run(sse_client.call_json(base, "POST", "/v1/completions", body))
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {out}")
    return time.perf_counter() - start


def engine_figures(trees: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    workers = {n: Worker(t, WORKER, [str(args.model_dir), str(args.threads)])
               for n, t in trees.items()}
    try:
        for w in workers.values():
            w.ask(tokens=64, chunk=args.chunk)  # warm: first calls, kernel build
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in trees}
        for rep in range(args.reps):
            for n in alternating(list(trees), rep):
                runs[n].append(workers[n].ask(tokens=args.tokens, chunk=args.chunk))
    finally:
        for w in workers.values():
            w.close()
    return {n: {"best_s": min(r["seconds"] for r in rs), "runs": rs} for n, rs in runs.items()}


def stack_figures(trees: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    extra = ["--device", "cpu", "--threads", str(args.threads),
             "--max-tokens-per-tick", str(args.chunk)]
    pairs = {n: ServerPair(model=str(args.model_dir), extra_args=extra, repo=t)
             for n, t in trees.items()}
    rng = random.Random(args.seed)
    try:
        for pair in pairs.values():
            pair.start()
        models = {n: served_model(p.base_url) or str(args.model_dir) for n, p in pairs.items()}
        for n, pair in pairs.items():
            cold_request(pair.base_url, models[n], 64, rng)  # warm
        runs: dict[str, list[float]] = {n: [] for n in trees}
        for rep in range(args.reps):
            for n in alternating(list(trees), rep):
                runs[n].append(cold_request(pairs[n].base_url, models[n], args.tokens, rng))
    finally:
        for pair in pairs.values():
            pair.stop()
    return {n: {"best_s": min(rs), "runs_s": rs} for n, rs in runs.items()}


def report(res: dict[str, Any]) -> None:
    print(f"\n=== cold prefill, {res['tokens']} tokens, chunks of {res['chunk']}, "
          f"{res['threads']} threads ===")
    for part, rows in res["figures"].items():
        for n, row in rows.items():
            runs = row.get("runs_s") or [r["seconds"] for r in row["runs"]]
            print(f"  {part:<6} {n:<8} best {row['best_s']:.3f} s  "
                  f"(runs {', '.join(f'{s:.3f}' for s in runs)})")
        ours = rows["this"]["best_s"]
        if "against" in rows:
            print(f"  {part:<6} this / against: {ours / rows['against']['best_s']:.2f}x")
        ratio = ours / VLLM_TTFT_S
        print(goal_line(f"{part} TTFT / vLLM's {VLLM_TTFT_S} s (AVX2 host)", ratio, f"<= {GOAL}x",
                        ratio <= GOAL))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=SMOLLM_135M_DIR)
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout to measure the same way, interleaved")
    parser.add_argument("--tokens", type=int, default=1516)
    parser.add_argument("--chunk", type=int, default=512, help="--max-tokens-per-tick")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stack", action="store_true", help="the engine figure only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = results_dir(args.out, "bench-prefill")
    ensure_checkpoint(args.model_dir)
    trees = {"this": REPO}
    if args.against is not None:
        trees["against"] = args.against.resolve()
    res: dict[str, Any] = {"tokens": args.tokens, "chunk": args.chunk, "threads": args.threads,
                           "vllm_ttft_s": VLLM_TTFT_S, "trees": {n: str(t) for n, t in trees.items()},
                           "figures": {"engine": engine_figures(trees, args)}}
    if not args.no_stack:
        res["figures"]["stack"] = stack_figures(trees, args)
    report(res)
    write_json(out / "prefill.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
