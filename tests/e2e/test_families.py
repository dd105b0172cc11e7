"""Each family beside Llama served by the real daemon and proxy (the CPU kernels, a KV pool
small enough to preempt, prefill in chunks), through the official openai client: the greedy
tokens of a completion (n=2) and of a chat turn equal transformers' generate on the same
checkpoint, past the families' 16-token sliding windows. tests/e2e/test_real_checkpoints.py
serves them with their real tokenizers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import torch

from tests.support.checkpoints import (
    CHAT_TEMPLATE,
    FAMILIES,
    LONGROPE_AFTER,
    WINDOW,
    save_family,
)
from tests.support.greedy import PROMPTS
from tests.support.pair import Server, start_server

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 32
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": NEW_TOKENS,
                          "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@dataclass
class Served:
    server: Server
    client: openai.OpenAI
    model: str
    hf: Any  # transformers' model of the checkpoint
    tokenizer: Any  # and its tokenizer

    def generate(self, ids: list[int]) -> list[int]:
        prompt = torch.tensor([ids])
        out = self.hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                               max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        return list(out[0, len(ids):].tolist())


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp(f"family-{request.param}")
    hf = save_family(path, request.param)
    server = start_server(tmp_path_factory.mktemp(f"pair-{request.param}"),
                          ["--model", str(path), "--max-num-seqs", "4", "--kv-cache-blocks", "8",
                           "--max-tokens-per-tick", "24"])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                            bos_token="<s>", eos_token="</s>")
        tokenizer.chat_template = CHAT_TEMPLATE
        yield Served(server, client, client.models.list().data[0].id, hf, tokenizer)
    finally:
        server.stop()


def token_ids(choice: Any) -> list[int]:
    ids: list[int] = (choice.model_extra or {}).get("token_ids", [])
    return ids


def test_completion_tokens_equal_transformers(served: Served) -> None:
    r = served.client.completions.create(model=served.model, prompt=PROMPTS[0], n=2, **GREEDY)
    expected = served.generate(served.tokenizer.encode(PROMPTS[0]))
    assert [token_ids(c) for c in r.choices] == [expected, expected]
    assert r.usage is not None and r.usage.prompt_tokens + NEW_TOKENS > 4 * WINDOW


def test_chat_tokens_equal_transformers(served: Served) -> None:
    messages = [{"role": "user", "content": PROMPTS[2]}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "why?"}]
    r = served.client.chat.completions.create(model=served.model, messages=messages,  # type: ignore[arg-type]
                                              **GREEDY)
    prompt = served.tokenizer.apply_chat_template(messages, tokenize=True,
                                                  add_generation_prompt=True, return_dict=False)
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    assert WINDOW < len(prompt) and len(prompt) + NEW_TOKENS <= LONGROPE_AFTER  # see test_families.py
    assert token_ids(r.choices[0]) == served.generate(prompt)
