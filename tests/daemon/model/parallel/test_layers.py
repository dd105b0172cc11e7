"""Sharding without processes: each rank's slices, put back together, are the whole model.

Loading needs no collective, so a rank's shard can be built here with a TPGroup that names a
rank and a size; the forward pass across real processes is tests/daemon/model/parallel/test_runner.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from daemon.model.config import ConfigError, ModelConfig
from daemon.model.loader import ModelLoadError, load_model
from daemon.model.parallel.group import TPGroup
from daemon.model.parallel.layers import Part, ShardSpec, check_shardable, head_parts, shard_of

Checkpoint = Callable[..., tuple[Path, torch.nn.Module]]


def config(heads: int = 4, kv_heads: int = 2, intermediate: int = 128) -> ModelConfig:
    return ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=intermediate,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=16)


def test_shard_spec_cuts_each_part_and_pads() -> None:
    full = torch.arange(10.0)[:, None].expand(10, 2)
    spec = ShardSpec(0, (Part(6, 3, 6), Part(4, 0, 1)), pad=2)
    assert spec.full_shape(torch.Size([6, 2])) == (10, 2)
    assert spec.take(full)[:, 0].tolist() == [3, 4, 5, 6, 0, 0]


def test_kv_heads_split_or_replicate() -> None:
    def kv_heads(cfg: ModelConfig, size: int) -> list[tuple[int, int]]:
        parts = [head_parts(cfg, TPGroup(r, size)) for r in range(size)]
        return [(kv.start, kv.stop) for _, kv in parts]

    assert kv_heads(config(4, 2), 2) == [(0, 1), (1, 2)]
    assert kv_heads(config(8, 4), 2) == [(0, 2), (2, 4)]
    # Fewer KV heads than ranks: each rank holds the one its query heads read.
    assert kv_heads(config(4, 2), 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_heads(config(4, 1), 2) == [(0, 1), (0, 1)]


def test_unshardable_shapes_name_the_field() -> None:
    check_shardable(config(4, 2), 2)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(9\) is not divisible by "
                                          r"--tensor-parallel-size 2"):
        check_shardable(config(9, 3), 2)
    with pytest.raises(ConfigError, match=r"intermediate_size \(130\)"):
        check_shardable(config(intermediate=130), 4)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\)"):
        check_shardable(config(6, 2, intermediate=129), 3)
    with pytest.raises(ModelLoadError, match=r"builtin:small: num_attention_heads \(9\)"):
        load_model("builtin:small", "cpu", torch.float32, group=TPGroup(0, 2))


def _whole(shards: list[torch.nn.Module], name: str) -> torch.Tensor:
    """A parameter put back together from every rank's slice (padding dropped)."""
    params = [dict(m.named_parameters())[name] for m in shards]
    first = shard_of(params[0])
    if first is None:
        for p in params[1:]:
            assert torch.equal(p, params[0]), f"{name} differs between ranks"
        return params[0]
    # Per part, its slices by range: a replicated KV head is one range held by several ranks.
    slices: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in first.parts]
    for p in params:
        spec = shard_of(p)
        assert spec is not None
        at = 0
        for i, part in enumerate(spec.parts):
            n = part.stop - part.start
            slices[i][part.start, part.stop] = p.narrow(spec.dim, at, n)
            at += n
    parts = [torch.cat([s for _, s in sorted(d.items())], first.dim) for d in slices]
    return torch.cat(parts, first.dim)


@pytest.mark.parametrize("size", [2, 4])
def test_builtin_shards_are_cut_from_the_same_seeded_model(size: int) -> None:
    whole = load_model("builtin:tiny", "cpu", torch.float32, kernels="torch").model
    shards = [load_model("builtin:tiny", "cpu", torch.float32, group=TPGroup(r, size)).model
              for r in range(size)]
    assert [m.num_kv_heads for m in shards] == [2 // size or 1] * size
    for name, param in whole.named_parameters():
        assert torch.equal(_whole(shards, name), param), name


def test_checkpoint_shards_read_only_their_slices(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.checkpoints import write_tokenizer

    # An odd vocabulary (padded on the last rank), one KV head (replicated), biases, untied.
    cfg = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                      attention_bias=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    # The torch modules: the CPU kernels would repack the whole model's weights.
    whole = load_model(str(tmp_path), "cpu", torch.float32, kernels="torch").model
    shards = [load_model(str(tmp_path), "cpu", torch.float32, group=TPGroup(r, 2)).model
              for r in range(2)]
    assert shards[1].embed_tokens.weight.shape == (151, 64)
    assert torch.equal(shards[1].embed_tokens.weight[-1], torch.zeros(64))
    for name, param in whole.named_parameters():
        assert torch.equal(_whole(shards, name), param), name


def test_a_kv_memory_budget_holds_twice_the_blocks_when_each_rank_holds_half_the_heads() -> None:
    from daemon.model.parallel.load import kv_cache_blocks
    from tests.support.options import model_options

    options = model_options(kv_cache_mib=8)
    whole = load_model("builtin:tiny", "cpu", torch.float32)
    half = load_model("builtin:tiny", "cpu", torch.float32, group=TPGroup(1, 2))
    assert kv_cache_blocks(options, half) == 2 * kv_cache_blocks(options, whole) > 0
