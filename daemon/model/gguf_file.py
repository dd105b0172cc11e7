"""GGUF files (llama.cpp's format, as Ollama and LM Studio hold models) read with the `gguf`
package: the metadata, typed, each error naming the key; the sampling defaults; the tensors,
their shapes as Hugging Face lays them out ([out, in]) and their values dequantized to float32
(computing on quantized blocks is a kernel's work, not a reader's). What each family's keys
and tensors mean is gguf_families.py's; loading them into a model, gguf_load.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
TENSOR_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
                Q.Q4_K, Q.Q5_K, Q.Q6_K)
# general.sampling.* -> SamplingParams' field (llama.cpp's names for a model's recommended
# sampling, written by its converter from generation_config.json).
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


class GGUFError(ValueError):
    """The file is not a GGUF file tether can serve; the message names the key or tensor."""


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf in a folder without a config.json
    (a checkpoint folder); None when it names none. Several .gguf files in one folder are an
    error naming them, since nothing says which to serve."""
    if path.is_file():
        return path if path.suffix == ".gguf" or _has_magic(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(f"{path}: holds {len(files)} .gguf files "
                        f"({', '.join(f.name for f in files)}); give --model one of them")
    return files[0] if files else None


def _has_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One opened file; every error names the file and the key or tensor at fault."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not _has_magic(path):
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, IndexError, TypeError, OSError) as e:
            # A tensor's data past the end of the file, a string past it, a type id no GGUF
            # version defines: the reader fails on them as it meets them.
            raise GGUFError(f"{path}: truncated or corrupt GGUF file ({e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.string("general.architecture")
        for tensor in self.reader.tensors:
            if tensor.tensor_type not in TENSOR_TYPES:
                raise GGUFError(f"{path}: tensor {tensor.name!r} is of type "
                                f"{tensor.tensor_type.name}, which is not supported (supported: "
                                f"{', '.join(t.name for t in TENSOR_TYPES)})")

    # ---- metadata

    def get(self, key: str) -> Any:
        """The value of `key` (str, int, float, bool or a list of them); None when absent."""
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def string(self, key: str) -> str:
        value = self.require(key)
        if not isinstance(value, str):
            raise GGUFError(f"{self.path}: metadata key {key!r} must be a string")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key) if default is not None else self.require(key)
        if value is None:
            return int(default or 0)
        if isinstance(value, list):  # per-layer values (OpenELM's head counts)
            raise GGUFError(f"{self.path}: metadata key {key!r} holds one value per layer, "
                            "which is not supported")
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.path}: metadata key {key!r} must be an integer")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key) if default is not None else self.require(key)
        if value is None:
            return float(default or 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GGUFError(f"{self.path}: metadata key {key!r} must be a number")
        return float(value)

    @property
    def name(self) -> str:
        """The model's id for clients: the file's name without .gguf, which says what a user
        chose (SmolLM2-135M-Instruct.Q4_1) where general.name may not ('Smollm2 135M 8k ...')."""
        return self.path.name.removesuffix(".gguf")

    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's recommended sampling (general.sampling.*), by SamplingParams field."""
        out: dict[str, float | int] = {}
        for key, field in SAMPLING_KEYS.items():
            if self.get(key) is not None:
                out[field] = self.integer(key) if field == "top_k" else self.number(key)
        return out

    # ---- tensors

    def dequantized(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in Hugging Face's layout [out, in], as the file holds it."""
        tensor = self.tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise GGUFError(f"{self.path}: tensor {name!r} cannot be dequantized: {e}") from e
        return np.require(values, np.float32, ["W"])  # F32 tensors are views of the file

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape in Hugging Face's layout [out, in] (GGUF lists it innermost
        first), as its header says, without reading its data."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))
