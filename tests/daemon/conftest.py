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
