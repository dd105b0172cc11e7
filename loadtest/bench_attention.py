"""Decode attention alone: the kernel that reads the paged cache in place against the gathering
reference, per layer call, at several batch sizes and context lengths.

    python -m loadtest.bench_attention [--device cpu|cuda] [--streams 1 64] [--contexts 256 1024 2048]

On CPU the kernel is daemon/model/kernels/cpu_attention.c, on CUDA the Triton kernel. Shapes: tiny
(builtin:tiny's 4 heads, 2 KV heads, head_dim 64) and 8b (32 heads, 8 KV heads, 128). Blocks are
scattered over the pool as a long-running server leaves them. Reports ms per call and the K/V
bytes read per second; writes attention.json under results/bench-attention-<timestamp>/.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from daemon.model.attention import AttentionMetadata, PagedAttention
from loadtest.report import results_dir, write_json

SHAPES = {"tiny": (4, 2, 64), "8b": (32, 8, 128)}
BLOCK = 16


def setup(streams: int, context: int, shape: str, dtype: torch.dtype, device: str,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    heads, kv_heads, head_dim = SHAPES[shape]
    per_seq = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    pool = streams * per_seq + 1
    cache = torch.randn(2, pool, kv_heads, BLOCK, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(pool, generator=gen)[: streams * per_seq].view(streams, per_seq)
    lens = torch.full((streams,), context)
    q = torch.randn(streams, heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), streams, tables.to(device),
                             lens.to(device), [])
    return q.to(device), cache.to(device), meta


def kernel_for(device: str) -> tuple[str, PagedAttention]:
    if device == "cuda":
        from daemon.model.kernels.triton_attention import TritonPagedAttention

        return "triton", TritonPagedAttention()
    from daemon.model.kernels import cpu
    from daemon.model.kernels.cpu_modules import CpuPagedAttention

    lib = cpu.load()
    if lib is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu.failure()}")
    return "cpu", CpuPagedAttention(lib)


def time_call(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Best of `reps` (seconds); interleaving is done by the caller."""
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    name, kernel = kernel_for(args.device)
    rows = []
    for shape in args.shapes:
        for streams in args.streams:
            for context in args.contexts:
                r = measure(name, kernel, shape, streams, context, args)
                rows.append(r)
                print(f"  {shape:<5} {streams:>4} x {context:>5}  {name} {r['kernel_ms']:8.3f} ms "
                      f"({r['kernel_gb_s']:6.1f} GB/s)  gather {r['gather_ms']:8.3f} ms  "
                      f"x{r['gather_ms'] / r['kernel_ms']:5.1f}  err {r['max_abs_err']:.1e}",
                      flush=True)
    return rows


def measure(name: str, kernel: PagedAttention, shape: str, streams: int, context: int,
            args: argparse.Namespace) -> dict[str, Any]:
    q, cache, meta = setup(streams, context, shape, args.dtype, args.device)
    k_cache, v_cache = cache[0], cache[1]
    reference = PagedAttention()
    kv_bytes = 2 * streams * context * cache.shape[2] * cache.shape[4] * cache.element_size()
    got = kernel.decode(q, k_cache, v_cache, meta)
    want = reference.decode(q.float(), k_cache.float(), v_cache.float(), meta)
    calls = {name: lambda: kernel.decode(q, k_cache, v_cache, meta),
             "gather": lambda: reference.decode(q, k_cache, v_cache, _fresh(meta))}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(args.rounds):  # A/B interleaved: both see the same load
        for key, call in calls.items():
            best[key] = min(best[key], time_call(call, args.device, 3))
    return {"shape": shape, "streams": streams, "context": context, "kernel": name,
            "kernel_ms": best[name] * 1e3, "gather_ms": best["gather"] * 1e3,
            "max_abs_err": float((got.float() - want).abs().max()),
            "kernel_gb_s": kv_bytes / best[name] / 1e9}


def _fresh(meta: AttentionMetadata) -> AttentionMetadata:
    # The reference caches its mask on the metadata; a new tick builds it again.
    return AttentionMetadata(meta.write_rows, meta.num_decode_tokens, meta.decode_block_tables,
                             meta.decode_context_lens, [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 "
                        "on CPU, bfloat16 on CUDA)")
    parser.add_argument("--shapes", nargs="+", default=["tiny"], choices=list(SHAPES))
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda"
                                               else "float32"))
    torch.set_num_threads(args.threads)
    print(f"=== decode attention, {args.device}, {args.dtype}, {args.threads} threads ===")
    rows = run(args)
    out = results_dir(args.out, "bench-attention")
    write_json(out / "attention.json", {"device": args.device, "dtype": str(args.dtype),
                                        "threads": args.threads, "rows": rows})
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
