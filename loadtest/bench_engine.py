"""Decode speed: the machine's roofline, our engine and transformers `generate`, one run.

    python -m loadtest.bench_engine [--threads 2] [--baseline] [--kl] [--out DIR]

Figures, all measured in this run (A/B interleaved where both sides share the process):
  bandwidth  read bandwidth (`a.sum()` over 1 GiB) at 1 thread and at --threads
  roofline   weight bytes per decode token / bandwidth; batch-1 forward (in process) and
             inter-token latency over HTTP as a fraction of it, for builtin:small and for an
             HF checkpoint of SmolLM-135M's shape with its full 49k-row head, at --threads
             and at the daemon's default thread count (against the 1-thread bandwidth)
  streams    --streams (8) concurrent requests: our tok/s vs transformers generate at batch 8
  mix        --mix requests of mixed lengths, continuous batching vs static batches of 32
  ticks      builtin:tiny decode tick at 1 and 64 streams, 256 / 400 / 1024 / 2040 context,
             and the 64-stream tick against its roofline (loadtest/roofline.py)
  kl         (--kl) logit KL of int8 and bf16 weights against fp32, fixed prompt set
--baseline adds the torch-ops path (`--kernels torch`, what tether ran before the kernels) to
every figure. The checkpoint is random, written once with save_pretrained (plus a byte-level
tokenizer) to --model-dir. Writes engine.json under results/bench-engine-<timestamp>/.
Goals: >= 80% of the roofline at batch 1; >= 2.5x transformers at 8 streams; tiny's 64-stream
tick within 2x of max(bytes / bandwidth, FLOPs / fp32 peak) + the host cost (sim:0's tick).
--ticks-only measures tiny's ticks and that roofline alone.
--tensor-parallel-size N measures TP=1 against TP=N instead: loadtest/bench_tp.py.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from loadtest import bench_tp, host_ticks, roofline, sse_client
from loadtest import decode_figures as figs
from loadtest.checkpoint import SMOLLM_135M_DIR, ensure_checkpoint
from loadtest.pair import ServerPair, served_model
from loadtest.report import goal_line, results_dir, write_json

ANCHOR = {"transformers_batch1": 17, "transformers_batch8": 68, "transformers_batch32": 191}
CONFIGS = {"ours": "auto", "baseline": "torch"}  # server name -> --kernels


def workload(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(16, 256), rng.randint(16, 128)) for _ in range(n)]


# --- ours, over HTTP -------------------------------------------------------------------------


async def ours_requests(base: str, model: str, jobs: list[tuple[int, int]]) -> dict[str, Any]:
    """All `jobs` (prompt bytes, new tokens) at once; wall time and the usage figures."""

    async def one(prompt_len: int, gen_len: int) -> tuple[int, int]:
        body = {"model": model, "prompt": "a" * prompt_len, "max_tokens": gen_len,
                "ignore_eos": True, "temperature": 0.0}
        status, out = await sse_client.call_json(base, "POST", "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {out}")
        return int(out["usage"]["prompt_tokens"]), int(out["usage"]["completion_tokens"])

    start = time.perf_counter()
    usage = await asyncio.gather(*(one(p, g) for p, g in jobs))
    wall = time.perf_counter() - start
    generated = sum(g for _, g in usage)
    return {"wall_s": wall, "new_tokens": generated, "tok_per_s": generated / wall,
            "prompt_tokens": [p for p, _ in usage]}


def ours_itl(base: str, model: str, prompt_len: int, gen_len: int) -> float:
    """Seconds per token after the first, one request at a time: (time for gen_len tokens -
    time for one) / (gen_len - 1), the same subtraction as for transformers. (Arrival times
    of streamed events would not do: a random byte-level model's tokens are often partial
    UTF-8, held back until they make text.)"""
    many = asyncio.run(ours_requests(base, model, [(prompt_len, gen_len)]))["wall_s"]
    one = asyncio.run(ours_requests(base, model, [(prompt_len, 1)]))["wall_s"]
    return (many - one) / (gen_len - 1)


def serve(model_dir: Path, kernels: str, args: argparse.Namespace,
          threads: int | None) -> ServerPair:
    extra = ["--dtype", args.dtype, "--device", "cpu", "--kernels", kernels]
    if threads is not None:
        extra += ["--threads", str(threads)]
    return ServerPair(model=str(model_dir), max_num_seqs=max(64, args.mix),
                      extra_args=extra)


def run_ours(model_dir: Path, args: argparse.Namespace,
             mix: list[tuple[int, int]]) -> dict[str, Any]:
    """Each server's figures, the servers taking turns round by round."""
    names = ["ours", "baseline"] if args.baseline else ["ours"]
    pairs: dict[str, ServerPair] = {}
    try:
        for name in names:
            pairs[name] = serve(model_dir, CONFIGS[name], args, args.threads).start()
        models = {n: served_model(p.base_url) or str(model_dir) for n, p in pairs.items()}
        res: dict[str, Any] = {n: {"itl_s": float("inf")} for n in names}
        streams = [(args.prompt_len, args.gen_len)] * args.streams
        for _ in range(args.rounds):
            for n, pair in pairs.items():
                asyncio.run(ours_requests(pair.base_url, models[n], [(8, 4)]))  # warm-up
                itl = ours_itl(pair.base_url, models[n], args.prompt_len, args.gen_len)
                res[n]["itl_s"] = min(res[n]["itl_s"], itl)
                got = asyncio.run(ours_requests(pair.base_url, models[n], streams))
                if got["tok_per_s"] > res[n].get("streams", {}).get("tok_per_s", 0):
                    res[n]["streams"] = got
        for n, pair in pairs.items():
            res[n]["mix"] = asyncio.run(ours_requests(pair.base_url, models[n], mix))
        return res
    finally:
        for pair in pairs.values():
            pair.stop()


def default_threads_itl(model_dir: Path, args: argparse.Namespace) -> float:
    """Inter-token latency with the daemon's own thread count (--threads left out)."""
    with serve(model_dir, "auto", args, None) as pair:
        model = served_model(pair.base_url) or str(model_dir)
        asyncio.run(ours_requests(pair.base_url, model, [(8, 4)]))
        return min(ours_itl(pair.base_url, model, args.prompt_len, args.gen_len)
                   for _ in range(args.rounds))


# --- transformers ----------------------------------------------------------------------------


def run_transformers(model_dir: Path, args: argparse.Namespace, prompt_lens: list[int],
                     gen_lens: list[int], batch1_prompt: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)

    def generate(lens: list[int], new: int) -> float:
        ids, mask = left_padded(lens, gen)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        return time.perf_counter() - start

    generate([8], 4)  # warm-up
    n, b = args.gen_len, args.streams
    # Per token after the first: the prefill and first token are timed apart and taken off.
    itl = min((generate([batch1_prompt], n) - generate([batch1_prompt], 1)) / (n - 1)
              for _ in range(args.rounds))
    streams = min(generate([batch1_prompt] * b, n) for _ in range(args.rounds))
    start = time.perf_counter()
    for i in range(0, len(prompt_lens), args.batch):
        generate(prompt_lens[i:i + args.batch], max(gen_lens[i:i + args.batch]))
    mix_wall = time.perf_counter() - start
    return {"itl_s": itl, "streams": {"wall_s": streams, "tok_per_s": b * n / streams},
            "mix": {"wall_s": mix_wall, "tok_per_s": sum(gen_lens) / mix_wall,
                    "batch": args.batch}}


def left_padded(lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte-token prompts of `lens` as (input_ids, attention_mask), left-padded so that
    every row ends at the same column, as `generate` wants them."""
    width = max(lens)
    ids = torch.zeros((len(lens), width), dtype=torch.long)
    mask = torch.zeros((len(lens), width), dtype=torch.long)
    for row, n in enumerate(lens):
        ids[row, width - n:] = torch.randint(1, 257, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


# --- in process ------------------------------------------------------------------------------


def run_in_process(model_dir: Path, args: argparse.Namespace,
                   default_threads: int) -> dict[str, Any]:
    """Bandwidth, batch-1 forward ticks against the roofline, tiny's tick scaling, KL."""
    kernels = {"ours": "auto", "baseline": "torch"} if args.baseline else {"ours": "auto"}
    bandwidth = figs.Bandwidth()
    # Keyed by thread count as a string, so that engine.json stays plain JSON.
    out: dict[str, Any] = {"bandwidth": {}, "forward": {}}
    for spec in () if args.ticks_only else ("builtin:small", str(model_dir)):
        tickers = {n: figs.Ticker(spec, k, args.dtype, max_tokens=4096)
                   for n, k in kernels.items()}
        nbytes = figs.model_weight_bytes(next(iter(tickers.values())).loaded, None)
        batches = {n: t.chunks(1, args.prompt_len) for n, t in tickers.items()}
        row: dict[str, Any] = {"weight_bytes": nbytes}
        for threads in sorted({1, args.threads, default_threads}):
            torch.set_num_threads(threads)
            for n, t in tickers.items():
                t.tick(batches[n])  # warm
            # The bandwidth is read between the ticks, so both see the same background load.
            calls: dict[str, Callable[[], float]] = {"read": bandwidth.seconds}
            calls.update({n: functools.partial(t.tick, batches[n]) for n, t in tickers.items()})
            best = figs.interleaved(calls, args.rounds * 5)
            bytes_s = max(bandwidth.nbytes / best["read"],
                          out["bandwidth"].get(str(threads), 0.0))
            out["bandwidth"][str(threads)] = bytes_s
            row[str(threads)] = {"roofline_ms": nbytes / bytes_s * 1e3,
                                 **{n: best[n] * 1e3 for n in kernels}}
        out["forward"]["builtin:small" if spec.startswith("builtin") else "hf"] = row
        del tickers
    torch.set_num_threads(default_threads)
    if str(default_threads) not in out["bandwidth"]:  # --ticks-only
        out["bandwidth"][str(default_threads)] = bandwidth.nbytes / min(
            bandwidth.seconds() for _ in range(args.rounds * 5))
    del bandwidth
    tiny = {n: figs.Ticker("builtin:tiny", k) for n, k in kernels.items()}
    # 2040, not 2048: the new token of a 2048-token context would sit past tiny's positions.
    out["ticks"] = figs.tick_scaling(tiny, [1, 64], [256, 400, 1024, 2040], args.rounds)
    out["roofline"] = tiny_roofline(tiny["ours"], out["ticks"],
                                    out["bandwidth"][str(default_threads)], args.rounds)
    if args.kl:
        out["kl"] = kl_figures(model_dir, args)
    torch.set_num_threads(args.threads)
    return out


def tiny_roofline(tiny: figs.Ticker, ticks: list[dict[str, Any]], bandwidth: float,
                  rounds: int) -> dict[str, Any]:
    """builtin:tiny's 64-stream ticks against max(bytes / bandwidth, FLOPs / peak) + the host
    cost (sim:0's 64-stream tick), at the daemon's thread count."""
    peak = roofline.peak_flops(rounds)
    host_s = host_ticks.measure(64, 100)["tick_us"] / 1e6
    config = tiny.loaded.config
    vocab = tiny.loaded.model.vocab_limit or config.vocab_size
    rows = [roofline.bound(config, 64, r["context"], vocab, bandwidth, peak, host_s,
                           r["ours"] / 1e3) for r in ticks if r["streams"] == 64]
    return {"peak_flops": peak, "bandwidth": bandwidth, "host_s": host_s, "rows": rows}


def kl_figures(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    ref = figs.Ticker(str(model_dir), "auto", "float32", max_tokens=4096)
    variants = {"int8": figs.Ticker(str(model_dir), "auto", "float32", "int8", 4096),
                "bfloat16": figs.Ticker(str(model_dir), "auto", "bfloat16", None, 4096)}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 257, (32,), generator=gen).tolist() for _ in range(8)]
    return figs.logit_kl(ref, variants, prompts, steps=32)


# --- report --------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> None:
    proc, threads = res["in_process"], res["threads"]
    bw = proc["bandwidth"]
    print(f"\n=== decode at the machine's limit ({res['dtype']}, {threads} threads; "
          f"daemon default {res['default_threads']}) ===")
    print("  read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s"
                                           for t, b in bw.items()))
    names = [n for n in CONFIGS if n in res["tether"]]
    for model, row in proc["forward"].items():
        for t in sorted(k for k in row if k.isdigit()):
            cell = row[t]
            shown = "  ".join(f"{n} {cell[n]:6.2f} ms ({cell['roofline_ms'] / cell[n]:4.0%})"
                              for n in names)
            print(f"  forward, batch 1, {model:<13} {t} thr: roofline {cell['roofline_ms']:6.2f} "
                  f"ms ({row['weight_bytes'] / 1e6:.0f} MB)  {shown}")
    hf = proc["forward"]["hf"]
    itls = {threads: res["tether"]["ours"]["itl_s"],
            res["default_threads"]: res["default_threads_itl_s"]}  # roofline: that count's
    for t, itl in itls.items():
        frac = hf[str(t)]["roofline_ms"] / (itl * 1e3)
        print(goal_line(f"HTTP inter-token latency / roofline, {t} thr", frac, ">= 0.8",
                        frac >= 0.8))
    theirs = res["transformers"]
    print(f"  transformers generate: {theirs['itl_s'] * 1e3:.1f} ms/token at batch 1, "
          f"{theirs['streams']['tok_per_s']:.1f} tok/s at batch {res['streams']}")
    for n in names:
        ours = res["tether"][n]
        ratio = ours["streams"]["tok_per_s"] / theirs["streams"]["tok_per_s"]
        print(f"  {n}: {ours['itl_s'] * 1e3:.1f} ms/token at batch 1, "
              f"{ours['streams']['tok_per_s']:.1f} tok/s at {res['streams']} streams, "
              f"mix {ours['mix']['tok_per_s']:.1f} tok/s "
              f"(transformers static {theirs['mix']['tok_per_s']:.1f})")
        print(goal_line(f"{n} / transformers, {res['streams']} streams", ratio,
                        ">= 2.5x", ratio >= 2.5))
    report_ticks(res)
    for name, kl in proc.get("kl", {}).items():
        print(f"  logit KL vs fp32, {name}: mean {kl['kl_mean']:.2e}, max {kl['kl_max']:.2e}, "
              f"top-1 agreement {kl['top1_agree']:.1%}")
    print(f"  anchor (transformers, another run): {ANCHOR}")


def report_ticks(res: dict[str, Any]) -> None:
    """builtin:tiny's tick against context and streams, and its roofline."""
    proc = res["in_process"]
    names = [n for n in CONFIGS if n in proc["ticks"][0]]
    print("  builtin:tiny decode tick, ms (" + " / ".join(names) + "):")
    for row in proc["ticks"]:
        print(f"    {row['streams']:>3} streams x {row['context']:>5} context: "
              + " / ".join(f"{row[n]:8.2f}" for n in names))
    roof = proc["roofline"]
    print(f"  roofline of tiny's 64-stream tick: {roof['bandwidth'] / 1e9:.1f} GB/s, fp32 peak "
          f"{roof['peak_flops'] / 1e9:.0f} GFLOP/s, host (sim:0) {roof['host_s'] * 1e3:.2f} ms")
    for r in roof["rows"]:
        print(f"    {r['context']:>5} context: {r['bytes'] / 1e6:6.1f} MB {r['memory_ms']:6.2f} ms,"
              f" {r['flops'] / 1e9:5.2f} GFLOP {r['compute_ms']:6.2f} ms; bound "
              f"{r['bound_ms']:6.2f} ms, tick {r['tick_ms']:6.2f} ms")
        print(goal_line(f"tiny 64-stream tick / bound, {r['context']} ctx", r["ratio"],
                        "<= 2x", r["ratio"] <= 2))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=SMOLLM_135M_DIR)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--baseline", action="store_true",
                        help="also measure the torch-ops path (--kernels torch)")
    parser.add_argument("--kl", action="store_true", help="logit KL of int8 and bf16 weights")
    parser.add_argument("--ticks-only", action="store_true",
                        help="only builtin:tiny's ticks and their roofline (in process)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--mix", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="> 1: TP=1 against TP=N instead (loadtest/bench_tp.py)")
    args, _ = parser.parse_known_args(argv)
    if args.tensor_parallel_size > 1:
        return bench_tp.main(argv)
    args = parser.parse_args(argv)  # the flags of this benchmark, strictly
    out = results_dir(args.out, "bench-engine")
    ensure_checkpoint(args.model_dir)
    default_threads = max(1, (os.cpu_count() or 1) - 1)  # as daemon/server.py picks
    mix = workload(args.mix, args.seed)
    res: dict[str, Any] = {"model_dir": str(args.model_dir), "threads": args.threads,
                           "default_threads": default_threads, "dtype": args.dtype,
                           "streams": args.streams, "workload": mix}
    res["in_process"] = run_in_process(args.model_dir, args, default_threads)
    if args.ticks_only:
        report_ticks(res)
        write_json(out / "engine.json", res)
        return 0
    res["tether"] = run_ours(args.model_dir, args, mix)
    res["default_threads_itl_s"] = (res["tether"]["ours"]["itl_s"]
                                    if default_threads == args.threads
                                    else default_threads_itl(args.model_dir, args))
    prompt_lens = res["tether"]["ours"]["mix"]["prompt_tokens"]
    res["transformers"] = run_transformers(args.model_dir, args, prompt_lens,
                                           [g for _, g in mix],
                                           res["tether"]["ours"]["streams"]["prompt_tokens"][0])
    report(res)
    write_json(out / "engine.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
