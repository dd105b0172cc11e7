"""The sampling fields, token ids in and out, echo, /tokenize and the rest-of-the-context default
through the official openai client (vLLM's fields in extra_body) on the real pair: each one
honoured, visibly, or refused naming it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.pair import Server, assert_baseline
from tests.support.raw_http import sse_json

pytestmark = pytest.mark.timeout(180)

CONTEXT = 2048  # builtin:tiny's; its byte tokenizer makes one token of each ASCII character
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24}
MESSAGES: Any = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    extra = {"ignore_eos": True, "return_token_ids": True, **kwargs.pop("extra_body", {})}
    r = client.chat.completions.create(model="builtin:tiny", messages=MESSAGES,
                                       **{**GREEDY, **kwargs}, extra_body=extra)
    return r.choices[0]


def ids(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])


def test_every_sampling_field_changes_what_the_model_says(client: openai.OpenAI) -> None:
    plain = ids(chat(client))
    for kwargs in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.5},
                   {"extra_body": {"repetition_penalty": 1.8}}):
        assert ids(chat(client, **kwargs)) != plain, kwargs
    # logit_bias: OpenAI's keys are token ids as strings; the byte tokenizer's "a" is 97.
    assert set(ids(chat(client, logit_bias={"97": 100}))) == {97}
    banned = ids(chat(client, logit_bias={str(t): -100 for t in set(plain)}))
    assert not set(banned) & set(plain)
    # bad_words win over a bias; stop_token_ids end the answer at once.
    assert 97 not in ids(chat(client, logit_bias={"97": 100}, extra_body={"bad_words": ["a"]}))
    stopped = chat(client, logit_bias={"97": 100}, extra_body={"stop_token_ids": [97]})
    assert (ids(stopped), stopped.finish_reason) == ([97], "stop")
    # min_p = 1 keeps only the most likely token: sampling is greedy.
    assert ids(chat(client, temperature=1.0, seed=3, extra_body={"min_p": 1.0})) == plain
    sampled = [ids(chat(client, temperature=1.0, seed=s, extra_body={"min_p": 0.0}))
               for s in (1, 2)]
    assert sampled[0] != sampled[1]


def test_the_fields_are_validated_naming_them(client: openai.OpenAI) -> None:
    for kwargs, param in (({"presence_penalty": 3}, "presence_penalty"),
                          ({"logit_bias": {"97": 101}}, "logit_bias"),
                          ({"logit_bias": {"999999": 1}}, "logit_bias"),
                          ({"extra_body": {"min_p": 2}}, "min_p"),
                          ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty")):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, **kwargs)
        assert info.value.body["param"] == param, kwargs  # type: ignore[index]


def test_token_id_prompts_and_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = [ord(c) for c in "hello"]
    r = client.completions.create(model="builtin:tiny", prompt=[prompt, prompt[:2]], echo=True,
                                  logprobs=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    first, second = r.choices
    assert first.text.startswith("hello") and second.text.startswith("he")
    lp = first.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.tokens[:5] == list("hello") and len(lp.tokens) == 5 + 3
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 6)
    # The same prompt as text gives the same answer after the echo (its BOS first).
    text = client.completions.create(model="builtin:tiny", prompt="hello", echo=True,
                                     max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert text.choices[0].text.startswith("hello")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="builtin:tiny", prompt=[1, 999999], max_tokens=1)
    assert info.value.body["param"] == "prompt"  # type: ignore[index]


def test_tokenize_and_detokenize(server: Server) -> None:
    with server.client() as c:
        r = c.post("/tokenize", json={"prompt": "héllo"}).json()
        assert r == {"count": 7, "max_model_len": CONTEXT,
                     "tokens": [256, *"héllo".encode()]}  # <bos> and the bytes
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
        chat_ids = c.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        bare = c.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
        assert chat_ids[0] == 256 and len(bare.json()["tokens"]) < len(chat_ids)
        usage = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
        assert usage["usage"]["prompt_tokens"] == len(chat_ids)


def test_continuous_usage_is_in_every_chunk(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="builtin:tiny", prompt="hi", max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) == len(
        [c for c in chunks if c.choices])
    assert all(c.usage is not None and c.usage.prompt_tokens == 3 for c in chunks)


def test_an_omitted_max_tokens_is_the_rest_of_the_context(server: Server) -> None:
    """A prompt that leaves less than any fixed default would: answered to the context's end,
    never refused for a limit the client did not set."""
    long = "x" * 1900
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": long}], "ignore_eos": True}).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == CONTEXT
        r = c.post("/v1/completions", json={"prompt": long, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == CONTEXT - 1901
        r = c.post("/v1/responses", json={"input": long, "ignore_eos": True}).json()
        assert (r["status"], r["incomplete_details"], r["max_output_tokens"]) == (
            "incomplete", {"reason": "max_output_tokens"}, None)
        assert r["usage"]["input_tokens"] + r["usage"]["output_tokens"] == CONTEXT
        # Only a prompt that fills the context is too long, and it is named.
        too_long = [{"role": "user", "content": "x" * 2100}]
        r = c.post("/v1/chat/completions", json={"messages": too_long})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
        # A stream says the same.
        body = {"prompt": long, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/completions", json=body) as s:
            usage = [e["usage"] for e in map(sse_json, s.iter_lines()) if e and e.get("usage")]
        assert usage[-1]["completion_tokens"] == CONTEXT - 1901
    assert_baseline(server.metrics())
