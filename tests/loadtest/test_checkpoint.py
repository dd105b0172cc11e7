"""The benchmarks' Hugging Face folder of a GGUF file's weights: the same model, loadable without
the file."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loadtest.checkpoint import ensure_gguf_folder
from tests.support.gguf_files import PROMPT, Q, family_model, transformers_logits, write_gguf


def test_a_gguf_file_becomes_a_folder_of_the_same_model(tmp_path: Path) -> None:
    # Q8_0 blocks (2-D weights) so that the folder holds dequantized numbers, not the originals.
    gguf = write_gguf(tmp_path / "tiny.gguf", family_model("qwen2"),
                      lambda name: Q.Q8_0 if name.endswith("_proj.weight") else Q.F32)
    folder = ensure_gguf_folder(gguf, tmp_path / "hf")
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, transformers_logits(gguf, PROMPT))
    text = "hello world"
    assert (AutoTokenizer.from_pretrained(folder).encode(text)
            == AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).encode(text))
    # A second call finds the folder and leaves it be.
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert ensure_gguf_folder(gguf, folder) == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp
