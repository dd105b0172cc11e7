"""--gpu-memory-utilization F: the KV cache gets what is left of F x the GPU's memory.

As in vLLM, F is the share of the device's total memory this daemon may use, everything
counted: weights, the activations of the largest tick (measured by a profile pass of that
tick), what the process took outside torch's allocator (cuBLAS workspaces, compiled kernels),
the CUDA graphs' pool, and the KV cache, which gets the rest. Memory other processes hold
does not count against F, but F x total must be free when the daemon starts. The CUDA
context created before the first reading counts as theirs (a few hundred MiB).

`plan_kv_cache` is the arithmetic alone (tested on CPU); `snapshot_at_start` and `measure`
read the device.
"""

from __future__ import annotations

import dataclasses

import torch

from daemon.model.batch import ScheduledChunk
from daemon.model.loader import LoadedModel
from daemon.model.runner import ModelRunner

GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True, slots=True)
class Start:
    total: int  # the device's memory, bytes
    free: int  # free before the weights were loaded
    reserved: int  # held by torch's caching allocator then (0 in a fresh process)


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    free: int  # free after the profile pass
    reserved: int  # held by torch's allocator after it
    peak_reserved: int  # the allocator's peak, the profile pass included
    weights: int  # held by the allocator once the weights were loaded, before the profile
    profile_cache: int  # the profile pass's own KV cache (freed before the real one is made)


@dataclasses.dataclass(frozen=True, slots=True)
class KvPlan:
    allowed: int  # F x total
    weights: int
    activations: int  # the profile pass's peak above the weights, its KV cache left out
    other: int  # taken from the device outside torch's allocator
    graphs: int  # kept for the CUDA graphs' pool (at most what the profiled tick needed)
    kv_bytes: int
    num_blocks: int

    def describe(self) -> str:
        return (f"{self.kv_bytes / GIB:.2f} GiB for the KV cache ({self.num_blocks} blocks) "
                f"of the {self.allowed / GIB:.2f} GiB allowed, after weights "
                f"{self.weights / GIB:.2f} GiB, activations {self.activations / GIB:.2f} GiB, "
                f"CUDA graphs {self.graphs / GIB:.2f} GiB, other {self.other / GIB:.2f} GiB")


def plan_kv_cache(start: Start, measured: Measured, utilization: float, bytes_per_block: int,
                  graphs: bool) -> KvPlan:
    """Raises ValueError (naming --gpu-memory-utilization) when F x total is not free or
    leaves no room for one block."""
    allowed = int(start.total * utilization)
    if allowed > start.free:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} asks for {allowed / GIB:.2f} GiB of the "
            f"GPU's {start.total / GIB:.2f} GiB, but only {start.free / GIB:.2f} GiB are free "
            "(other processes hold the rest): lower it")
    weights = measured.weights - start.reserved
    activations = max(0, measured.peak_reserved - measured.weights - measured.profile_cache)
    taken = start.free - measured.free  # by this process since the start
    other = max(0, taken - (measured.reserved - start.reserved))
    graph_pool = activations if graphs else 0
    kv_bytes = allowed - weights - activations - other - graph_pool
    num_blocks = max(0, kv_bytes) // bytes_per_block
    plan = KvPlan(allowed, weights, activations, other, graph_pool, kv_bytes, num_blocks)
    if num_blocks < 1:
        raise ValueError(f"--gpu-memory-utilization {utilization} leaves no room for the KV "
                         f"cache: {plan.describe()}; raise it")
    return plan


def snapshot_at_start(device: torch.device) -> Start:
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    return Start(total=total, free=free, reserved=torch.cuda.memory_reserved(device))


def profile_chunks(max_num_seqs: int, max_tokens_per_tick: int, max_model_len: int,
                   block_size: int) -> tuple[list[list[ScheduledChunk]], int]:
    """The ticks that need the most memory, and the blocks they use: the longest prefill
    chunk at the end of the longest context, then max_num_seqs decodes that all need
    logits."""
    n = min(max_tokens_per_tick, max_model_len)
    blocks = -(-max_model_len // block_size)
    table = list(range(blocks))
    prefill = [ScheduledChunk([0] * n, max_model_len - n, table, True)]
    decodes = [ScheduledChunk([0], i % block_size, [blocks + i], True)
               for i in range(max_num_seqs)]
    return [prefill, decodes], blocks + max_num_seqs


def measure(loaded: LoadedModel, max_num_seqs: int, max_tokens_per_tick: int,
            block_size: int = 16) -> Measured:
    """Runs the profile ticks (and a sort of their logits, as top-p sampling does) on a
    throw-away cache."""
    device = loaded.model.inv_freq.device
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_reserved(device)
    ticks, num_blocks = profile_chunks(max_num_seqs, max_tokens_per_tick,
                                       loaded.max_model_len, block_size)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks, block_size)
    cache = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    for chunks in ticks:
        logits = runner.run(chunks)
        torch.softmax(logits.sort(dim=-1, descending=True).values, dim=-1)
    torch.cuda.synchronize(device)
    del runner, logits
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return Measured(free=free, reserved=torch.cuda.memory_reserved(device),
                    peak_reserved=torch.cuda.max_memory_reserved(device), weights=weights,
                    profile_cache=cache)
