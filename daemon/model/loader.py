"""Builds a runnable model from a spec: 'builtin:tiny', 'builtin:small', an HF directory, a GGUF
file (or a folder holding one, or 'package:NAME', the one an installed package ships:
daemon/model/gguf_load.py).

Built-in models are random Llamas from a fixed seed paired with the byte tokenizer: no
download, identical on every machine, varied (if meaningless) output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.decoder import DecoderLM
from daemon.model.device import pick_device, pick_dtype
from daemon.model.kernels import install as install_kernels
from daemon.model.loaded import (
    LoadedModel,
    ModelLoadError,
    check_shardable_at,
    generation_defaults,
    hf_sources,
)
from daemon.model.parallel.group import SINGLE, TPGroup
from daemon.model.parallel.layers import ShardSpec, shard_of
from daemon.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerLoadError,
    read_json_object,
)

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "pick_device", "pick_dtype"]

BUILTIN_SEED = 1234
INIT_STD = 0.02


def builtin_config(name: str) -> ModelConfig:
    byte_vocab = ByteTokenizer().vocab_size
    eos = ByteTokenizer().eos_token_ids
    if name == "tiny":
        return ModelConfig(vocab_size=byte_vocab, hidden_size=256, intermediate_size=688,
                           num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                           max_position_embeddings=2048, tie_word_embeddings=True,
                           bos_token_id=256, eos_token_ids=eos)
    if name == "small":  # SmolLM-135M's shape
        return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           max_position_embeddings=2048, tie_word_embeddings=True,
                           bos_token_id=256, eos_token_ids=eos)
    raise ModelLoadError(f"unknown built-in model 'builtin:{name}' "
                         "(available: builtin:tiny, builtin:small)")


def load_model(spec: str, device: torch.device | str = "cpu", dtype: torch.dtype | str = "auto",
               group: TPGroup = SINGLE, *, kernels: str = "auto",
               quantization: str | None = None) -> LoadedModel:
    """group: with several tensor-parallel ranks, this rank's shard of the model only.
    kernels: 'auto' (compiled kernels for the device, see daemon/model/kernels) or 'torch';
    quantization: None, 'int8' or 'int4' (weight-only, in blocks of 32 inputs as GGUF's Q8_0
    and Q4_1; CPU kernels only). With dtype 'auto', a GGUF file's quantized weights are
    computed on as they are (CPU kernels)."""
    device = pick_device(device) if isinstance(device, str) else device
    # A GGUF file's quantized tensors stay quantized where the CPU kernels can compute on
    # them, unless a dtype or a quantization of tether's own was asked for.
    keep_quantized = (dtype == "auto" and quantization is None and kernels == "auto"
                      and device.type == "cpu" and group.size == 1)
    dtype = pick_dtype(dtype, device) if isinstance(dtype, str) else dtype
    if spec.startswith("builtin:"):
        loaded = _load_builtin(spec, device, dtype, group)
    else:
        loaded = _load_path(spec, device, dtype, group, keep_quantized)
    try:
        loaded.kernels = install_kernels(loaded.model, device, kernels, quantization)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return loaded


def _load_builtin(spec: str, device: torch.device, dtype: torch.dtype,
                  group: TPGroup) -> LoadedModel:
    config = builtin_config(spec.removeprefix("builtin:"))
    check_shardable_at(spec, config, group)
    tokenizer = ByteTokenizer()
    limit = tokenizer.vocab_size if tokenizer.vocab_size < config.vocab_size else None
    model = DecoderLM(config, device, dtype, vocab_limit=limit, group=group)
    init_random_(model.requires_grad_(False), BUILTIN_SEED)
    return LoadedModel(config, model.eval(), tokenizer, spec, config.max_model_len)


@torch.no_grad()
def init_random_(model: DecoderLM, seed: int) -> None:
    """HF-style init: N(0, 0.02) matrices, unit norms, zero biases; same on any device. A
    sharded parameter is cut from the full tensor, so every rank count draws the same model."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            spec = shard_of(param)
            shape = param.shape if spec is None else spec.full_shape(param.shape)
            values = torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
            param.copy_(values if spec is None else spec.take(values))


def _load_path(spec: str, device: torch.device, dtype: torch.dtype, group: TPGroup,
               keep_quantized: bool = False) -> LoadedModel:
    # gguf (and numpy's dequantizers) only for GGUF files: built-in models start without them.
    from daemon.model import gguf_load
    from daemon.model.gguf_file import GGUFError, find_gguf

    if spec.startswith(gguf_load.PACKAGE_PREFIX):
        return gguf_load.load_gguf(gguf_load.package_gguf(spec), device, dtype, group,
                                   keep_quantized)
    try:
        file = find_gguf(Path(spec))
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e
    if file is not None:
        return gguf_load.load_gguf(file, device, dtype, group, keep_quantized)
    return _load_hf_dir(Path(spec), device, dtype, group)


# ---- Hugging Face checkpoints


def _load_hf_dir(path: Path, device: torch.device, dtype: torch.dtype,
                 group: TPGroup) -> LoadedModel:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory or a GGUF file (expected builtin:tiny, "
                             "builtin:small, a local Hugging Face checkpoint directory, a .gguf "
                             "file or a folder holding one)")
    raw = _read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
    generation = _read_json(path / "generation_config.json", required=False)
    eos = generation.get("eos_token_id")
    extra_eos = config.eos_token_ids + ([eos] if isinstance(eos, int) else list(eos or []))
    config.eos_token_ids = sorted(set(extra_eos))
    try:
        tokenizer = HFTokenizer.from_dir(path, config.eos_token_ids)
    except TokenizerLoadError as e:
        raise ModelLoadError(str(e)) from e
    config.eos_token_ids = tokenizer.eos_token_ids
    check_shardable_at(path / "config.json", config, group)
    model = DecoderLM(config, device, dtype, group=group).requires_grad_(False)
    load_weights_(model, path)
    return LoadedModel(config, model.eval(), tokenizer, model_id(path),
                       config.max_model_len,
                       generation_defaults=generation_defaults(generation))


def model_id(path: Path) -> str:
    """The id a checkpoint directory is served under: a Hugging Face cache snapshot
    (.../models--org--name/snapshots/<commit>) by its repo id, org/name (the hub forbids "--" in
    names, so the folder's name reads back unambiguously); any other directory by its name."""
    path = Path(os.path.abspath(path))  # "." and ".." named, a symlink's own name kept
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name


def _read_json(file: Path, required: bool = True) -> dict[str, Any]:
    if required and not file.is_file():
        raise ModelLoadError(f"{file}: missing")
    try:
        return read_json_object(file)
    except TokenizerLoadError as e:
        raise ModelLoadError(str(e)) from e


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file holding it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise ModelLoadError(f"{shard}: missing (listed in {index.name})")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{single}: missing (and no model.safetensors.index.json; "
                             "only safetensors weights are supported)")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:
        raise ModelLoadError(f"{single}: cannot be read: {e}") from e


@torch.no_grad()
def load_weights_(model: DecoderLM, path: Path) -> None:
    files = weight_files(path)
    sources = hf_sources(model.config, files)
    needed = {name for names in sources.values() for name in names}
    unused = [n for n in files if n not in needed and not _ignorable(n, model.config)]
    if unused:
        raise ModelLoadError(f"{files[unused[0]]}: tensor {unused[0]!r} is not used by a "
                             f"{model.config.architecture} without extras "
                             f"({len(unused)} such tensors)")
    params = dict(model.named_parameters())
    reader = _Reader(files, path)
    for ours, theirs in sources.items():
        param = params[ours]
        spec = shard_of(param)
        value = reader.whole(theirs[0]) if spec is None else reader.shard(theirs, spec, param)
        if value.shape != param.shape:
            raise ModelLoadError(f"{files[theirs[0]]}: {theirs} has shape "
                                 f"{tuple(value.shape)}, config.json implies "
                                 f"{tuple(param.shape)}")
        param.copy_(value)


def _ignorable(name: str, config: ModelConfig) -> bool:
    # Old checkpoints store RoPE tables; tied checkpoints sometimes store the head anyway.
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and config.tie_word_embeddings)


class _Reader:
    """Reads whole tensors or this rank's slices of them (safetensors reads only the slice)."""

    def __init__(self, files: dict[str, Path], path: Path) -> None:
        self.files, self.path = files, path
        self.handles: dict[Path, Any] = {}

    def whole(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shard(self, names: list[str], spec: ShardSpec, param: torch.Tensor) -> torch.Tensor:
        """The concatenation of each source tensor's slice (one source per part of `spec`, or
        one fused source holding the parts one after the other)."""
        if len(names) == 1 and len(spec.parts) > 1:
            return self._fused(names[0], spec, param)
        slices = []
        for name, part in zip(names, spec.parts, strict=True):
            source = self._handle(name).get_slice(name)
            shape = tuple(source.get_shape())
            expected = list(spec.full_shape(param.shape))
            expected[spec.dim] = part.size
            if shape != tuple(expected):
                raise ModelLoadError(f"{self.files[name]}: {name!r} has shape {shape}, "
                                     f"config.json implies {tuple(expected)}")
            index = (slice(None),) * spec.dim + (slice(part.start, part.stop),)
            slices.append(source[index])
        return spec.assemble(slices)

    def _fused(self, name: str, spec: ShardSpec, param: torch.Tensor) -> torch.Tensor:
        source = self._handle(name).get_slice(name)
        shape, expected = tuple(source.get_shape()), spec.full_shape(param.shape)
        if shape != expected:
            raise ModelLoadError(f"{self.files[name]}: {name!r} has shape {shape}, "
                                 f"config.json implies {expected}")
        slices, offset = [], 0
        for part in spec.parts:
            index = (slice(None),) * spec.dim + (slice(offset + part.start, offset + part.stop),)
            slices.append(source[index])
            offset += part.size
        return spec.assemble(slices)

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the "
                                 "safetensors files")
        file = self.files[name]
        if file not in self.handles:
            try:
                self.handles[file] = safe_open(str(file), framework="pt")
            except Exception as e:
                raise ModelLoadError(f"{file}: cannot be read: {e}") from e
        return self.handles[file]
