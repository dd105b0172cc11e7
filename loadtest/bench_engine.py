"""Our engine against transformers `generate` on one 135M checkpoint, fp32, CPU.

    python loadtest/bench_engine.py [--model-dir DIR] [--mix 64] [--out DIR]

The checkpoint is a randomly initialised LlamaForCausalLM of SmolLM-135M's shape, written once
with save_pretrained (plus a byte-level tokenizer.json) to --model-dir (default
/tmp/tether-bench-smollm135m); both sides load that directory. Ours is driven over HTTP
(`tether serve --model DIR --dtype float32`, non-streaming completions with ignore_eos), so
the figures include the proxy and the pipes.

  batch 1  one request, --prompt-len prompt tokens, --gen-len new tokens; tok/s = new / wall
  mix      --mix requests, prompts 16..256 and outputs 16..128 tokens (seeded); transformers
           in static batches of --batch (left-padded, each batch runs to its longest
           output), ours all at once (continuous batching); tok/s = requested new tokens / wall
Goals: ours >= 0.9x transformers at batch 1, >= 1.5x on the mix.
Anchor (this machine class, transformers): 17 tok/s at batch 1, 68 at 8, 191 at 32.
Writes engine.json under results/bench-engine-<timestamp>/ (or --out).
--tensor-parallel-size N measures TP=1 against TP=N instead: loadtest/bench_tp.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import sse_client

DEFAULT_DIR = Path("/tmp/tether-bench-smollm135m")
SMOLLM_135M: dict[str, Any] = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
               "pad_token_id": 0}
ANCHOR = {"transformers_batch1": 17, "transformers_batch8": 68, "transformers_batch32": 191}


def write_checkpoint(path: Path, config: dict[str, Any] = SMOLLM_135M) -> None:
    """Random SmolLM-135M-shaped Llama + a byte-level tokenizer (one token per byte)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


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


def run_ours(model_dir: Path, args: argparse.Namespace,
             mix: list[tuple[int, int]]) -> dict[str, Any]:
    extra = ["--dtype", "float32", "--device", "cpu"]
    with common.ServerPair(model=str(model_dir), max_num_seqs=max(64, args.mix),
                           extra_args=extra) as pair:
        model = common.served_model(pair.base_url) or str(model_dir)
        asyncio.run(ours_requests(pair.base_url, model, [(8, 4)]))  # warm-up
        b1 = asyncio.run(ours_requests(pair.base_url, model, [(args.prompt_len, args.gen_len)]))
        mixed = asyncio.run(ours_requests(pair.base_url, model, mix))
    return {"batch1": b1, "mix": mixed}


# --- transformers ----------------------------------------------------------------------------


def run_transformers(model_dir: Path, args: argparse.Namespace,
                     prompt_lens: list[int], gen_lens: list[int],
                     batch1_prompt: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)

    def generate(lens: list[int], new: int) -> None:
        width = max(lens)
        ids = torch.zeros((len(lens), width), dtype=torch.long)
        mask = torch.zeros((len(lens), width), dtype=torch.long)
        for row, n in enumerate(lens):  # left padding: every row ends at the same column
            ids[row, width - n:] = torch.randint(1, 257, (n,), generator=gen)
            mask[row, width - n:] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)

    generate([8], 4)  # warm-up
    start = time.perf_counter()
    generate([batch1_prompt], args.gen_len)
    b1_wall = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(prompt_lens), args.batch):
        generate(prompt_lens[i:i + args.batch], max(gen_lens[i:i + args.batch]))
    mix_wall = time.perf_counter() - start
    useful = sum(gen_lens)
    return {"batch1": {"wall_s": b1_wall, "new_tokens": args.gen_len,
                       "tok_per_s": args.gen_len / b1_wall},
            "mix": {"wall_s": mix_wall, "new_tokens": useful, "tok_per_s": useful / mix_wall,
                    "batch": args.batch}}


# --- driver ----------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> None:
    print(f"\n=== engine benchmark (SmolLM-135M shape, fp32, {res['threads']} threads) ===")
    print(f"  {'case':<10} {'transformers tok/s':>20} {'tether tok/s':>14} {'ratio':>7}")
    goals = {"batch1": 0.9, "mix": 1.5}
    for case, goal in goals.items():
        theirs = res["transformers"][case]["tok_per_s"]
        ours = res["tether"][case]["tok_per_s"] if res.get("tether") else None
        ratio = ours / theirs if ours else None
        print(f"  {case:<10} {theirs:>20.1f} {ours or float('nan'):>14.1f} "
              f"{ratio or float('nan'):>7.2f}")
        print(common.goal_line(f"tether / transformers, {case}", ratio, f">= {goal}x",
                               None if ratio is None else ratio >= goal))
    print(f"  anchor (transformers): {ANCHOR}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--mix", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-ours", action="store_true", help="transformers side only")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="> 1: TP=1 against TP=N instead (loadtest/bench_tp.py)")
    args, _ = parser.parse_known_args(argv)
    if args.tensor_parallel_size > 1:
        import bench_tp

        return bench_tp.main(argv)
    out = common.results_dir(args.out, "bench-engine")
    if not (args.model_dir / "config.json").is_file():
        print(f"writing a random SmolLM-135M-shaped checkpoint to {args.model_dir}", flush=True)
        write_checkpoint(args.model_dir)
    mix = workload(args.mix, args.seed)
    res: dict[str, Any] = {"model_dir": str(args.model_dir), "threads": args.threads,
                           "workload": mix}
    prompt_lens = [p for p, _ in mix]
    batch1_prompt = args.prompt_len
    if not args.skip_ours:
        res["tether"] = run_ours(args.model_dir, args, mix)
        # Give transformers exactly the prompt lengths our tokenizer produced.
        prompt_lens = res["tether"]["mix"]["prompt_tokens"]
        batch1_prompt = res["tether"]["batch1"]["prompt_tokens"][0]
    res["transformers"] = run_transformers(args.model_dir, args, prompt_lens,
                                           [g for _, g in mix], batch1_prompt)
    report(res)
    common.write_json(out / "engine.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
