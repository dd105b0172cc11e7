"""The daemon's engine around a checkpoint's CPU runner, in this process: the decode tick at N
streams, and the forward pass inside it.

    python loadtest/decode_ticks.py CHECKPOINT_DIR MAX_STREAMS THREADS
        # JSON lines in ({"streams": N, "ticks": T}), out (figures)

Run by its path, as host_ticks.py (whose `measure` and `engine_around` it uses: the engine as
daemon/main.py builds it, N completions of a 64-token prompt, temperature 1, ignore_eos), so
that `PYTHONPATH=<another checkout>` measures that checkout's engine, runner and kernels
(bench_decode.py's --against). The ticks run at contexts of 64 to ~100 tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import host_ticks  # the sibling script (this file is run by its path)
import torch

from daemon.engine.core import Engine
from daemon.model.batch import ScheduledChunk
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner

MAX_TOKENS = 64  # per completion: the warm-up and the timed ticks fit in it


class TimedRunner:
    """The runner, each forward pass timed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.walls = runner, list[float]()
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runner.run(chunks)
        self.walls.append(time.perf_counter() - t0)
        return logits

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.copy_block(src, dst)


def main() -> int:
    checkpoint, max_streams, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    loaded = load_model(checkpoint, "cpu", "float32")
    runner = TimedRunner(ModelRunner(loaded.model, loaded.config,
                                     num_blocks=host_ticks.blocks_for(max_streams)))

    def build(streams: int, store_dir: Path) -> Engine:
        return host_ticks.engine_around(runner, loaded.tokenizer, streams,
                                        store_dir, loaded.max_model_len, loaded.name)

    for line in sys.stdin:
        ask = json.loads(line)
        runner.walls.clear()
        cell: dict[str, Any] = host_ticks.measure(int(ask["streams"]), int(ask["ticks"]),
                                                  MAX_TOKENS, build)
        forward_us = statistics.median(runner.walls[-cell["ticks"]:]) * 1e6
        print(json.dumps({**cell, "forward_us": forward_us,
                          "tok_per_s": cell["streams"] / cell["tick_us"] * 1e6}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
