"""Device and dtype resolution for the --device / --dtype settings, and the process's heap."""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(setting: str = "auto") -> torch.device:
    """'auto' = CUDA when present, else CPU; 'cuda' without CUDA is an error."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if setting not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {setting!r}")
    return torch.device(setting)


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """'auto' = float32 on CPU (fast matmuls there), bfloat16 on CUDA."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if setting not in _DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {setting!r}")
    return _DTYPES[setting]


# glibc's mallopt parameters (malloc.h) and the values keep_heap sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the most glibc accepts on 64-bit hosts
TRIM_THRESHOLD = 512 << 20


def keep_heap() -> bool:
    """Keep a tick's freed temporaries in the heap for the next tick (glibc only; False
    elsewhere). By default glibc maps each block over its moving threshold with mmap and hands
    the heap's free top back to the kernel past twice that, so the logits, probabilities and
    cumulative sums of a 64-sequence tick (12.6 MB each at a 49k vocabulary) came back as
    fresh pages every tick: ~5,000 page faults, each page zeroed by the kernel, ~10% of the
    tick on the CPU (docs/benchmarks.md). Blocks under 32 MiB now always come from the heap,
    and it keeps up to 512 MiB of free top; larger blocks (weights, the KV cache) are still
    mapped and unmapped on their own."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (AttributeError where libc is not glibc)
    except (OSError, AttributeError):
        return False
    done = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not done:
        log.warning("mallopt refused the heap thresholds; a tick's temporaries may page-fault")
    return done
