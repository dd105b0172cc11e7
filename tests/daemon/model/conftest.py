"""Session-wide checkpoints of the families beside Llama (built by tests/support/checkpoints.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import save_family


@pytest.fixture(scope="session")
def family(tmp_path_factory: pytest.TempPathFactory
           ) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """make(name of tests.support.checkpoints.FAMILIES) -> (directory, transformers model)."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"family-{name}")
            cache[name] = (path, save_family(path, name))
        return cache[name]

    return make
