"""Session-wide checkpoints and tokenizers for the daemon tests (built by tests/support)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import save_llama, write_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory
                     ) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """make(rope="none"|"llama3"|"linear", tie=False) -> (directory, transformers model)."""
    cache: dict[tuple[str, bool], tuple[Path, torch.nn.Module]] = {}

    def make(rope: str = "none", tie: bool = False) -> tuple[Path, torch.nn.Module]:
        if (rope, tie) not in cache:
            path = tmp_path_factory.mktemp(f"llama-{rope}-{'tied' if tie else 'untied'}")
            cache[rope, tie] = (path, save_llama(path, rope, tie))
        return cache[rope, tie]

    return make


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-tokenizer")
    write_tokenizer(path)
    return path


def random_cache(lens: list[int], kv_heads: int, head_dim: int, block: int = 16,
                 dtype: torch.dtype = torch.float32, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache [2, blocks, KVH, block, d], block tables [D, max_blocks], lens [D]); each
    sequence's blocks scattered over the pool, tables padded with block 0."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(2, num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq)
    tables = [[ids.pop() for _ in range(n)] + [0] * (width - n) for n in per_seq]
    return cache, torch.tensor(tables), torch.tensor(lens)
