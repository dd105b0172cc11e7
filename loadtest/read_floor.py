"""The read floor of a decode token: its packed weights read as they are held, a weight at a time
in the order a token reads them, nothing computed (read_floor.c, compiled here as the kernels are
and loaded after torch, so that it shares torch's OpenMP threads). bench_quant times it beside the
batch-1 forward: what the token's reads alone cost when they come a weight at a time, as the
kernels' linears read them. Its loop reads 1 GiB at 89-96% of `a.sum()`'s rate.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from daemon.model.kernels import cpu

SOURCE = Path(__file__).with_name("read_floor.c")


class ReadFloor:
    """`seconds()` reads every tensor of `weights` once, in order."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        compiler = cpu.c_compiler()
        self._dir = tempfile.TemporaryDirectory()
        lib = Path(self._dir.name) / "read_floor.so"
        done = subprocess.run([compiler, *cpu.FLAGS, "-march=native", "-shared", str(SOURCE),
                               "-o", str(lib)], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {done.stderr[-2000:]}")
        self.lib = ctypes.CDLL(str(lib))
        self.lib.tl_read_floor.restype = ctypes.c_float
        self.weights = weights  # kept alive: the pointers below are theirs
        self.nbytes = sum(w.numel() * w.element_size() for w in weights)
        self._ptrs = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
        self._bytes = (ctypes.c_int64 * len(weights))(
            *(w.numel() * w.element_size() for w in weights))

    def read(self) -> float:
        """Every weight read once; their bytes summed as float32 (the tail of a thread's share
        short of 256 bytes as bytes), which only keeps the reads from being dropped."""
        return float(self.lib.tl_read_floor(self._ptrs, self._bytes,
                                            ctypes.c_int64(len(self.weights))))

    def seconds(self) -> float:
        start = time.perf_counter()
        self.read()
        return time.perf_counter() - start
