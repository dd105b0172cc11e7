"""The model and its runner on every rank: `load_runner` is what `tether daemon` calls.

With one rank it is the plain ModelRunner; with N it spawns ranks 1..N-1 (rank.py), loads rank
0's shard and wraps its runner in a `DriverRunner` (driver.py).
"""

from __future__ import annotations

import logging
import time

import torch

from daemon.model import gpu_memory
from daemon.model.loader import LoadedModel, load_model, pick_device
from daemon.model.parallel import group as parallel
from daemon.model.parallel.driver import DriverRunner
from daemon.model.parallel.group import Ranks
from daemon.model.parallel.rank import spawner
from daemon.model.runner import ModelRunner
from daemon.options import ModelOptions

log = logging.getLogger("tether.daemon")


def kv_cache_blocks(options: ModelOptions, loaded: LoadedModel) -> int:
    """--kv-cache-blocks, or what --kv-cache-mib holds of this rank's KV heads."""
    if not options.kv_cache_mib:
        return options.kv_cache_blocks
    num_blocks = ModelRunner.blocks_for_budget(loaded.config, options.kv_cache_mib << 20,
                                               loaded.model.dtype,
                                               num_kv_heads=loaded.model.num_kv_heads)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-mib {options.kv_cache_mib} holds no KV block of this "
                         "model")
    return num_blocks


def load_runner(options: ModelOptions) -> tuple[LoadedModel, ModelRunner | DriverRunner,
                                                Ranks | None]:
    """The model and its runner on every rank; raises StartError, ModelLoadError, ValueError."""
    size = options.tensor_parallel_size
    torch.set_num_threads(parallel.threads_per_rank(options.threads, size))
    device = pick_device(options.device)
    quantization = None if options.quantization == "none" else options.quantization
    if options.gpu_memory_utilization and device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization sizes the KV cache from free GPU memory; "
                         f"the daemon runs on {device.type}: size it with --kv-cache-blocks "
                         "or --kv-cache-mib")
    if size == 1:
        start = gpu_memory.snapshot_at_start(device) if options.gpu_memory_utilization else None
        loaded = load_model(options.model, device, options.dtype, kernels=options.kernels,
                            quantization=quantization)
        return loaded, make_runner(options, loaded, start), None
    ranks = parallel.start(size, device.type, spawner(options))
    try:
        device = ranks.group.device or device
        start = gpu_memory.snapshot_at_start(device) if options.gpu_memory_utilization else None
        loaded = load_model(options.model, device, options.dtype,
                            group=ranks.group, kernels=options.kernels,
                            quantization=quantization)
        driver = DriverRunner(make_runner(options, loaded, start), ranks)
        driver.start()
    except BaseException:
        ranks.close()
        raise
    return loaded, driver, ranks


def make_runner(options: ModelOptions, loaded: LoadedModel,
                start: gpu_memory.Start | None = None) -> ModelRunner:
    """This rank's runner: the KV cache sized by the options (from `start`, the GPU's memory
    before loading, under --gpu-memory-utilization), the decode buckets captured as CUDA
    graphs where they can be (the Triton kernels, one rank)."""
    graphs = (options.cuda_graphs and loaded.kernels == "triton"
              and loaded.model.embed_tokens.group.size == 1)
    if start is None:
        num_blocks = kv_cache_blocks(options, loaded)
    else:
        measured = gpu_memory.measure(loaded, options.max_num_seqs,
                                      options.max_tokens_per_tick)
        per_block = ModelRunner.block_bytes(loaded.config, loaded.model.dtype,
                                            num_kv_heads=loaded.model.num_kv_heads)
        plan = gpu_memory.plan_kv_cache(start, measured, options.gpu_memory_utilization,
                                        per_block, graphs)
        log.info("--gpu-memory-utilization %s: %s", options.gpu_memory_utilization,
                 plan.describe())
        num_blocks = plan.num_blocks
    runner = ModelRunner(loaded.model, loaded.config, num_blocks,
                         graph_max_batch=options.max_num_seqs if graphs else 0)
    if graphs and runner.graphs is not None:
        t0 = time.monotonic()
        try:
            runner.capture()
        except Exception as e:  # a model op that cannot be captured: still serve, eagerly
            log.warning("CUDA graphs not captured (%s: %s); every tick runs eagerly",
                        type(e).__name__, e)
            runner.graphs = None
            return runner
        log.info("captured %d CUDA graphs of decode ticks (batch %s) in %.1f s",
                 len(runner.graphs.buckets), runner.graphs.buckets, time.monotonic() - t0)
    return runner
