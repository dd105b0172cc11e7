"""Tensor parallel: the engine at TP=1 and TP=N, tokens/s and the time each tick spends talking.

    python -m loadtest.bench_engine --tensor-parallel-size 2 [--threads 2] [--out DIR]
    python -m loadtest.bench_tp --tensor-parallel-size 2 [--models tiny,tp135m] [--device cuda]

Both sides are the daemon's own code path in this process (`load_runner`: rank 0 here, the
other ranks spawned), driven through the real engine, greedy, ignore_eos:

  batch1   one request, --prompt-len prompt tokens, --gen-len new tokens; tok/s = new / wall
  streams  --streams requests at once (the same lengths); tok/s = new tokens / wall
  ticks    per forward pass: wall time, and on each rank the time in the data collectives
           (all-reduces, logits gather; on CUDA synchronised) and on rank 0 the batch broadcast

Models: builtin:tiny, and `tp135m`, a random checkpoint of SmolLM-135M's size with 8 query /
4 KV heads (SmolLM's 9 heads do not split in two), written once to --model-dir. --threads is
the CPU threads in all, shared out between the ranks as the daemon does. On a 2-core machine
TP=2 is expected to be slower: there is no second device, only a second process to feed.
Writes tp.json under results/bench-tp-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.checkpoint import SMOLLM_135M, write_checkpoint
from loadtest.report import results_dir, write_json

# SmolLM-135M with 8 query / 4 KV heads: its own 9 heads do not split in two.
TP135M = {**SMOLLM_135M, "num_attention_heads": 8, "num_key_value_heads": 4}
DEFAULT_DIR = Path("/tmp/tether-bench-tp135m")


def generate(engine: Any, jobs: int, prompt_len: int, gen_len: int, tag: str) -> dict[str, float]:
    from ipc.records import RequestKind, SamplingParams, Submit

    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i in range(jobs):
        engine.submit(Submit(f"{tag}{i}", RequestKind.COMPLETION, params,
                             prompts=["a" * prompt_len], epoch=1))
    ticks0, tokens0 = engine.figures.num_ticks, engine.figures.num_generation_tokens
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    wall = time.perf_counter() - start
    new = engine.figures.num_generation_tokens - tokens0
    return {"wall_s": wall, "new_tokens": new, "tok_per_s": new / wall,
            "ticks": engine.figures.num_ticks - ticks0}


def tick_figures(runner: Any, before: list[Any], wall_s: float, ticks: int) -> dict[str, Any]:
    """Per forward pass over one phase: wall time and, per rank, time in collectives."""
    from daemon.model.parallel.driver import DriverRunner

    out: dict[str, Any] = {"tick_ms": 1e3 * wall_s / ticks}
    if not isinstance(runner, DriverRunner):
        return out
    after = runner.report()
    for b, a in zip(before, after, strict=True):
        runs = a.num_runs - b.num_runs
        out[f"rank{a.rank}"] = {
            "collective_ms": 1e3 * (a.collective_s - b.collective_s) / runs,
            "collectives": (a.num_collectives - b.num_collectives) / runs,
            "broadcast_ms": 1e3 * (a.send_s - b.send_s) / runs}
    return out


def one_config(spec: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from daemon.engine.core import Engine
    from daemon.model.parallel.driver import DriverRunner
    from daemon.model.parallel.load import load_runner
    from tether.options import daemon_options
    from tether.settings import Settings

    settings = Settings(model=spec, device=args.device, dtype=args.dtype, threads=args.threads,
                        tensor_parallel_size=tp, kv_cache_blocks=args.kv_blocks)
    loaded, runner, ranks = load_runner(daemon_options(settings).model)
    try:
        engine = Engine(runner, loaded.tokenizer, None, max(64, args.streams), 512,
                        loaded.max_model_len, loaded.name)
        generate(engine, 2, 8, 4, "warm")
        res: dict[str, Any] = {"threads_per_rank": torch.get_num_threads()}
        for case, jobs in (("batch1", 1), ("streams", args.streams)):
            before = runner.report() if isinstance(runner, DriverRunner) else []
            res[case] = generate(engine, jobs, args.prompt_len, args.gen_len, case)
            res[case].update(tick_figures(runner, before, res[case]["wall_s"],
                                          res[case]["ticks"]))
    finally:
        if ranks is not None:
            ranks.close()
    return res


def report(res: dict[str, Any]) -> None:
    tp = res["tensor_parallel_size"]
    print(f"\n=== tensor parallel: TP=1 vs TP={tp} ({res['device']}, {res['threads']} threads "
          "in all) ===")
    for model, by_tp in res["models"].items():
        print(f"  {model}")
        for case in ("batch1", "streams"):
            one, many = by_tp["1"][case], by_tp[str(tp)][case]
            ranks = [many[k] for k in sorted(many) if k.startswith("rank")]
            talk = ", ".join(f"rank {i} {r['collective_ms']:.2f} ms in {r['collectives']:.0f} "
                             f"collectives" for i, r in enumerate(ranks))
            print(f"    {case:<8} tok/s {one['tok_per_s']:8.1f} -> {many['tok_per_s']:8.1f} "
                  f"({many['tok_per_s'] / one['tok_per_s']:.2f}x); tick {one['tick_ms']:.2f} -> "
                  f"{many['tick_ms']:.2f} ms, of which {talk}; broadcast "
                  f"{ranks[0]['broadcast_ms']:.2f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--models", default="tiny,tp135m")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args, _ = parser.parse_known_args(argv)
    os.environ["TETHER_TP_TIMING"] = "1"  # time the collectives on CUDA too (every rank)
    out = results_dir(args.out, "bench-tp")
    specs = {"tiny": "builtin:tiny", "tp135m": str(args.model_dir)}
    models = [m for m in args.models.split(",") if m]
    if "tp135m" in models and not (args.model_dir / "config.json").is_file():
        print(f"writing a random 135M checkpoint (8 heads) to {args.model_dir}", flush=True)
        write_checkpoint(args.model_dir, TP135M)
    tp = args.tensor_parallel_size
    res: dict[str, Any] = {"tensor_parallel_size": tp, "threads": args.threads,
                           "device": args.device, "models": {}}
    for model in models:
        res["models"][model] = {str(n): one_config(specs[model], n, args) for n in (1, tp)}
        print(f"  {model}: {res['models'][model]}", flush=True)
    report(res)
    write_json(out / "tp.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
