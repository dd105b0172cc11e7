"""The model runner alone, in this process: a cold prompt's prefill in the scheduler's chunks.

    python loadtest/prefill_ticks.py MODEL_DIR   # JSON lines in ({"tokens": N, "chunk": C}), out

Run by its path, not as `loadtest.prefill_ticks`: it imports only daemon/, so that
`PYTHONPATH=<another checkout>` measures that checkout's model code with this file
(bench_prefill.py's --against). Each ask prefills a fresh random prompt of N byte tokens from
position 0, C tokens a forward pass (the daemon's --max-tokens-per-tick), and times it from the
first chunk to the last chunk's logits: the engine's part of a cold time to first token.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from daemon.model.batch import ScheduledChunk
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner

BLOCK = 16


def main() -> int:
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    loaded = load_model(sys.argv[1], "cpu", "float32", kernels="auto")
    max_len = loaded.config.max_position_embeddings
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=max_len // BLOCK + 1)
    table = list(range(runner.num_blocks))
    gen = torch.Generator().manual_seed(0)
    for line in sys.stdin:
        ask = json.loads(line)
        n, chunk = int(ask["tokens"]), int(ask["chunk"])
        ids = torch.randint(1, 257, (n,), generator=gen).tolist()
        start = time.perf_counter()
        ticks = []
        for pos in range(0, n, chunk):
            end = min(pos + chunk, n)
            t0 = time.perf_counter()
            runner.run([ScheduledChunk(ids[pos:end], pos, table, end == n)])
            ticks.append(time.perf_counter() - t0)
        print(json.dumps({"seconds": time.perf_counter() - start, "ticks_s": ticks,
                          "kernels": loaded.kernels}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
