"""The runner across ranks: rank 0 sends each batch, every rank runs the same forward pass.

`load_runner` is what `tether daemon` calls: with one rank it is the plain ModelRunner; with
N it spawns ranks 1..N-1 (`python -m daemon.model.parallel.runner SPEC`), loads rank 0's shard and
wraps its runner in a `DriverRunner`. The engine cannot tell the difference: it calls `run`
and `copy_block` as ever. Sampling happens on rank 0 alone, from the logits gathered there,
so every rank agrees on the tokens; an aborted session is simply absent from the next batch.

A batch crosses the control group as one int64 tensor:
``[RUN, chunks, copies, (src, dst) * copies, (start_pos, needs_logits, tokens, blocks,
token ids..., block ids...) * chunks]``. Copy-on-write block copies ride with the next batch:
the other ranks only need them done before their next forward pass.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from daemon.model import gpu_memory
from daemon.model.batch import ScheduledChunk
from daemon.model.loader import LoadedModel, load_model, pick_device
from daemon.model.parallel import group as parallel
from daemon.model.parallel.group import Ranks, StartError, TPGroup
from daemon.model.runner import ModelRunner
from tether.settings import Settings

log = logging.getLogger("tether.daemon")

RUN, INIT, REPORT = 1, 2, 3
_PR_SET_PDEATHSIG = 1


# --- the batch on the wire --------------------------------------------------------------------


def encode_run(chunks: Sequence[ScheduledChunk], copies: Sequence[tuple[int, int]]) -> Tensor:
    out = [RUN, len(chunks), len(copies)]
    for src, dst in copies:
        out += (src, dst)
    for c in chunks:
        out += (c.start_pos, int(c.needs_logits), len(c.token_ids), len(c.block_table))
        out += c.token_ids
        out += c.block_table
    return torch.tensor(out, dtype=torch.long)


def decode_run(message: Tensor) -> tuple[list[ScheduledChunk], list[tuple[int, int]]]:
    values = message.tolist()
    num_chunks, num_copies = values[1], values[2]
    copies = [(values[3 + 2 * i], values[4 + 2 * i]) for i in range(num_copies)]
    at = 3 + 2 * num_copies
    chunks: list[ScheduledChunk] = []
    for _ in range(num_chunks):
        start, logits, n_tokens, n_blocks = values[at : at + 4]
        at += 4
        tokens = values[at : at + n_tokens]
        blocks = values[at + n_tokens : at + n_tokens + n_blocks]
        at += n_tokens + n_blocks
        chunks.append(ScheduledChunk(tokens, start, blocks, bool(logits)))
    return chunks, copies


# --- rank 0 -------------------------------------------------------------------------------------


class RanksLost(RuntimeError):
    """A rank died, hung or broke the group; the daemon cannot go on."""


@dataclasses.dataclass(slots=True)
class RankFigures:
    """One rank's own count of what it ran (REPORT): for benchmarks and tests."""

    rank: int
    num_runs: int = 0
    num_tokens: int = 0
    collective_s: float = 0.0  # all-reduces and the logits gather
    num_collectives: int = 0
    send_s: float = 0.0  # rank 0: broadcasting the batches
    last_block_ids: list[int] = dataclasses.field(default_factory=list)

    def ran(self, chunks: Sequence[ScheduledChunk], group: TPGroup) -> None:
        self.num_runs += 1
        self.num_tokens += sum(len(c.token_ids) for c in chunks)
        self.collective_s, self.num_collectives = group.collective_s, group.num_collectives
        self.last_block_ids = sorted({b for c in chunks for b in c.block_table})


class DriverRunner:
    """Rank 0's runner when there are several ranks (the engine's Runner)."""

    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.figures = RankFigures(0)
        self._copies: list[tuple[int, int]] = []

    def start(self) -> None:
        """Give the other ranks the cache size and wait until each has its runner."""
        try:
            self.ranks.group.send(torch.tensor([INIT, self.num_blocks], dtype=torch.long))
            self.ranks.group.gather_object(None)
        except Exception as e:
            raise StartError(self.ranks.exited(wait_s=1.0) or f"tensor-parallel ranks: {e}") from e

    def run(self, chunks: list[ScheduledChunk]) -> Tensor:
        if not chunks:
            return self.runner.run(chunks)
        self.runner.check(chunks)  # a bad batch is refused here, before any other rank sees it
        try:
            t0 = time.perf_counter()
            self.ranks.group.send(encode_run(chunks, self._copies))
            self.figures.send_s += time.perf_counter() - t0
            self._copies = []
            logits = self.runner.run(chunks)
        except Exception as e:
            reason = self.ranks.failure or self.ranks.exited(wait_s=1.0) or (
                f"tensor-parallel forward pass failed: {type(e).__name__}: {e}")
            self.ranks.lost(reason)
            raise RanksLost(reason) from e
        self.figures.ran(chunks, self.ranks.group)
        return logits

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.copy_block(src, dst)
        self._copies.append((src, dst))

    def report(self) -> list[RankFigures]:
        """Every rank's own figures, rank 0 first."""
        self.ranks.group.send(torch.tensor([REPORT], dtype=torch.long))
        others = self.ranks.group.gather_object(None) or []
        # Plain dicts on the wire: the other ranks run this module as __main__.
        return [dataclasses.replace(self.figures),
                *(RankFigures(**f) for f in others[1:] if isinstance(f, dict))]


def kv_cache_blocks(settings: Settings, loaded: LoadedModel) -> int:
    """--kv-cache-blocks, or what --kv-cache-mib holds of this rank's KV heads."""
    if not settings.kv_cache_mib:
        return settings.kv_cache_blocks
    num_blocks = ModelRunner.blocks_for_budget(loaded.config, settings.kv_cache_mib << 20,
                                               loaded.model.dtype,
                                               num_kv_heads=loaded.model.num_kv_heads)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-mib {settings.kv_cache_mib} holds no KV block of this "
                         "model")
    return num_blocks


def load_runner(settings: Settings) -> tuple[LoadedModel, ModelRunner | DriverRunner,
                                             Ranks | None]:
    """The model and its runner on every rank; raises StartError, ModelLoadError, ValueError."""
    size = settings.tensor_parallel_size
    torch.set_num_threads(parallel.threads_per_rank(settings.threads, size))
    device = pick_device(settings.device)
    quantization = None if settings.quantization == "none" else settings.quantization
    if settings.gpu_memory_utilization and device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization sizes the KV cache from free GPU memory; "
                         f"the daemon runs on {device.type}: size it with --kv-cache-blocks "
                         "or --kv-cache-mib")
    if size == 1:
        start = gpu_memory.snapshot_at_start(device) if settings.gpu_memory_utilization else None
        loaded = load_model(settings.model, device, settings.dtype, kernels=settings.kernels,
                            quantization=quantization)
        return loaded, make_runner(settings, loaded, start), None
    ranks = parallel.start(size, device.type, _spawner(settings))
    try:
        device = ranks.group.device or device
        start = gpu_memory.snapshot_at_start(device) if settings.gpu_memory_utilization else None
        loaded = load_model(settings.model, device, settings.dtype,
                            group=ranks.group, kernels=settings.kernels,
                            quantization=quantization)
        driver = DriverRunner(make_runner(settings, loaded, start), ranks)
        driver.start()
    except BaseException:
        ranks.close()
        raise
    return loaded, driver, ranks


def make_runner(settings: Settings, loaded: LoadedModel,
                start: gpu_memory.Start | None = None) -> ModelRunner:
    """This rank's runner: the KV cache sized by the settings (from `start`, the GPU's memory
    before loading, under --gpu-memory-utilization), the decode buckets captured as CUDA
    graphs where they can be (the Triton kernels, one rank)."""
    graphs = (settings.cuda_graphs and loaded.kernels == "triton"
              and loaded.model.embed_tokens.group.size == 1)
    if start is None:
        num_blocks = kv_cache_blocks(settings, loaded)
    else:
        measured = gpu_memory.measure(loaded, settings.max_num_seqs,
                                      settings.max_tokens_per_tick)
        per_block = ModelRunner.block_bytes(loaded.config, loaded.model.dtype,
                                            num_kv_heads=loaded.model.num_kv_heads)
        plan = gpu_memory.plan_kv_cache(start, measured, settings.gpu_memory_utilization,
                                        per_block, graphs)
        log.info("--gpu-memory-utilization %s: %s", settings.gpu_memory_utilization,
                 plan.describe())
        num_blocks = plan.num_blocks
    runner = ModelRunner(loaded.model, loaded.config, num_blocks,
                         graph_max_batch=settings.max_num_seqs if graphs else 0)
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


def _spawner(settings: Settings) -> parallel.Spawn:
    # The spawned ranks are not systemd's business (NotifyAccess=main) and hold no FIFO.
    env = {k: v for k, v in os.environ.items()
           if k != "NOTIFY_SOCKET" and not k.startswith(("WATCHDOG_", "LISTEN_"))}

    def spawn(rank: int, port: int) -> subprocess.Popen[bytes]:
        spec = {"rank": rank, "size": settings.tensor_parallel_size, "port": port,
                "parent": os.getpid(), "model": settings.model, "device": settings.device,
                "dtype": settings.dtype, "kernels": settings.kernels,
                "threads": torch.get_num_threads(), "log_format": settings.log_format,
                "log_level": settings.log_level}
        return subprocess.Popen([sys.executable, "-m", "daemon.model.parallel.runner", json.dumps(spec)],
                                env=env, stdin=subprocess.DEVNULL)

    return spawn


# --- ranks 1..N-1 -------------------------------------------------------------------------------


def serve(group: TPGroup, runner: ModelRunner) -> None:
    """Run what rank 0 sends until it says stop."""
    figures = RankFigures(group.rank)
    while (message := group.receive()) is not None:
        op = int(message[0])
        if op == RUN:
            chunks, copies = decode_run(message)
            for src, dst in copies:
                runner.copy_block(src, dst)
            runner.run(chunks)
            figures.ran(chunks, group)
        elif op == REPORT:
            group.gather_object(dataclasses.asdict(figures))


def _follow_parent(parent: int) -> None:
    # Die with rank 0 even when it is SIGKILLed; SIGTERM and Ctrl-C are rank 0's to handle
    # (it drains, then tells this rank to leave).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    from tether import logs

    spec: dict[str, Any] = json.loads((argv or sys.argv[1:])[0])
    rank = spec["rank"]
    _follow_parent(spec["parent"])
    logs.setup(Settings(log_format=spec["log_format"], log_level=spec["log_level"]),
               f"daemon rank {rank}")
    torch.set_num_threads(spec["threads"])
    device = pick_device(spec["device"])
    try:
        group = parallel.join(rank, spec["size"], spec["port"], device.type)
    except Exception as e:
        log.error("rank %d cannot join rank 0: %s", rank, e)
        return 1
    try:
        loaded = load_model(spec["model"], group.device or device, spec["dtype"], group=group,
                            kernels=spec["kernels"])
        init = group.receive()
        if init is None:
            return 0
        runner = ModelRunner(loaded.model, loaded.config, int(init[1]))
        group.gather_object(None)
        serve(group, runner)
    except Exception as e:
        log.error("rank %d stops: %s: %s", rank, type(e).__name__, e)
        return 1
    finally:
        parallel.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
