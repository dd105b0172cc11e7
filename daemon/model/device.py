"""Device and dtype resolution for the --device / --dtype settings."""

from __future__ import annotations

import torch

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
