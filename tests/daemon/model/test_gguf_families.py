"""Each family tether serves from GGUF (daemon/model/gguf_*.py) on a tiny random file written
as llama.cpp's converter writes it: tether's logits equal those of the model the file was
written from, and those of transformers' own reading of the file where transformers reads it
as it is (not Granite, nor the RoPE scalings it drops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.model.loader import load_model
from tests.support.gguf_files import (
    GGUF_FAMILIES,
    PROMPT,
    family_model,
    logits,
    transformers_logits,
    write_gguf,
)


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_a_family_from_gguf_computes_what_its_model_computes(name: str, tmp_path: Path) -> None:
    model = family_model(name)
    path = write_gguf(tmp_path / f"tiny-{name}.gguf", model)
    loaded = load_model(str(path), "cpu", "float32", kernels="torch")
    assert loaded.config.architecture == type(model).__name__
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    ours = logits(loaded, PROMPT)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    if GGUF_FAMILIES[name][2]:
        torch.testing.assert_close(ours, transformers_logits(path, PROMPT), rtol=1e-4, atol=1e-4)
