"""Section e of gpu_check.py: the host cost per sequence per tick on the device machine, measured
as loadtest/host_ticks.py measures it (the engine in process, N completions of 256 tokens
decoding, the median of the timed ticks), at each of the case's stream counts:
  sim    `sim:0` in its own process on one torch thread (bench_host.py's engine figure, issue
         24's goal of <= 8 µs per sequence per tick), on this machine's CPU
  model  the 1B checkpoint on the daemon's own runner (CUDA graphs), each forward pass timed
         until the device has finished it: what a tick takes outside it is the engine's host
         work and the sampler, per sequence
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_case import Case
from gpu_engine import Left, build_runner, checkpoint, graph_figures

from daemon.engine.core import Engine
from daemon.model.batch import ScheduledChunk
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner
from loadtest import bench_host, host_ticks
from loadtest.pair import REPO


class TimedRunner:
    """The runner, each forward pass timed until the device has finished it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size, self.num_blocks = runner.block_size, runner.num_blocks
        self.walls: list[float] = []

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runner.run(chunks)
        if logits.is_cuda:
            torch.cuda.synchronize()
        self.walls.append(time.perf_counter() - t0)
        return logits

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.copy_block(src, dst)


def host(case: Case, left: Left) -> dict[str, Any]:
    levels = list(case.host_streams)
    sim = bench_host.run_engine({"this": REPO}, levels, case.host_reps,
                                case.host_ticks)["this"]
    model = checkpoint(case)
    loaded = load_model(model, case.device, case.dtype)
    most = max(levels)
    runner = TimedRunner(build_runner(case, loaded, host_ticks.blocks_for(most), most,
                                      max(512, 2 * most), graphs=True))

    def build(streams: int, store_dir: Path) -> Engine:
        return host_ticks.engine_around(runner, loaded.tokenizer, streams, store_dir,
                                        loaded.max_model_len, loaded.name)

    ours: dict[str, Any] = {}
    for streams in levels:
        runs = []
        for _ in range(case.host_reps):
            runner.walls.clear()
            cell = host_ticks.measure(streams, case.host_ticks, build=build)
            forward_us = statistics.median(runner.walls[-case.host_ticks :]) * 1e6
            runs.append({**cell, "forward_us": forward_us,
                         "outside_forward_us_per_seq": (cell["tick_us"] - forward_us) / streams})
        ours[str(streams)] = bench_host.medians(runs)
    top = str(most)
    out: dict[str, Any] = {"model": model, "levels": levels, "ticks": case.host_ticks,
                           "reps": case.host_reps, "sim": sim, "model_runner": ours,
                           "graphs": graph_figures(runner.runner)}
    out["goals"] = {f"sim:0 <= {bench_host.GOAL_US} us per sequence per tick at {top}":
                    sim[top]["us_per_seq"] <= bench_host.GOAL_US}
    out["headline"] = "; ".join(
        f"{n}: sim:0 {sim[str(n)]['us_per_seq']:.2f} us/seq/tick, the model's tick "
        f"{ours[str(n)]['tick_us'] / 1e3:.2f} ms of which outside the forward "
        f"{ours[str(n)]['outside_forward_us_per_seq']:.2f} us/seq" for n in levels)
    return out
