"""A checkpoint per real tokenizer family (the real tokenizer files plus random weights) served by
the real daemon and proxy, through the official openai client; transformers is the reference for
what the text, the token ids, the logprob tokens and the chat prompt must be."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.pair import Server, assert_baseline, start_server
from tests.support.real_tokenizers import FAMILIES, reference, save_random_checkpoint

pytestmark = pytest.mark.timeout(600)

PROMPT = "Tokyo 東京 🙂 naïve —"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24,
                          "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@dataclass
class Served:
    name: str
    server: Server
    client: openai.OpenAI
    ref: Any  # transformers' tokenizer
    model: str

    def continuation(self, prompt_ids: list[int], ids: list[int]) -> str:
        head = self.ref.decode(prompt_ids, skip_special_tokens=True)
        whole = self.ref.decode(prompt_ids + ids, skip_special_tokens=True)
        assert whole.startswith(head)
        return str(whole[len(head):])


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    name = request.param
    checkpoint = save_random_checkpoint(name, tmp_path_factory.mktemp(f"ckpt-{name}"))
    server = start_server(tmp_path_factory.mktemp(f"pair-{name}"),
                          ["--model", str(checkpoint), "--max-num-seqs", "4"])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield Served(name, server, client, reference(name), client.models.list().data[0].id)
    finally:
        server.stop()


def token_ids(choice: Any) -> list[int]:
    ids: list[int] = (choice.model_extra or {}).get("token_ids", [])
    return ids


def test_completion_text_token_ids_and_logprobs(served: Served) -> None:
    r = served.client.completions.create(model=served.model, prompt=PROMPT, logprobs=2,
                                         **GREEDY)
    [choice] = r.choices
    ids = token_ids(choice)
    assert len(ids) == 24 and r.usage is not None and r.usage.completion_tokens == 24
    prompt_ids = served.ref.encode(PROMPT)  # with the BOS the family adds
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert choice.text == served.continuation(prompt_ids, ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 24
    # Streaming the same greedy request gives the same text in pieces, and the same ids.
    stream = served.client.completions.create(model=served.model, prompt=PROMPT, stream=True,
                                              **GREEDY)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [i for c in chunks for i in token_ids(c)] == ids


def test_chat_logprob_bytes_add_up_to_the_content(served: Served) -> None:
    if served.ref.chat_template is None:
        pytest.skip(f"{served.name} ships no chat template (its 400 is checked below)")
    messages = MESSAGES if served.name != "gemma" else MESSAGES[1:]  # Gemma 2's: no system turn
    r = served.client.chat.completions.create(model=served.model, messages=messages,  # type: ignore[arg-type]
                                              logprobs=True, top_logprobs=2, **GREEDY)
    [choice] = r.choices
    content = (choice.logprobs.content if choice.logprobs else None) or []
    assert b"".join(bytes(t.bytes or ()) for t in content) == (choice.message.content or "").encode()
    for token in content:
        assert token.bytes == (token.top_logprobs[0].bytes)  # greedy: the top one
    prompt_ids = served.ref.apply_chat_template(messages, tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt_ids)
    assert choice.message.content == served.continuation(prompt_ids, token_ids(choice))


def test_stop_strings_straddling_tokens(served: Served) -> None:
    r = served.client.completions.create(model=served.model, prompt=PROMPT, **GREEDY)
    full, ids = r.choices[0].text, token_ids(r.choices[0])
    prompt_ids = served.ref.encode(PROMPT)
    # Boundaries between the tokens of the output, as character offsets in it.
    cuts = sorted({len(served.continuation(prompt_ids, ids[:k])) for k in range(1, len(ids))})
    cuts = [c for c in cuts if 2 <= c <= len(full) - 1 and full[c - 2:c + 1].strip()][:3]
    assert cuts, f"no token boundary to straddle in {full!r}"
    for cut in cuts:
        stop = full[cut - 2:cut + 1]
        s = served.client.completions.create(model=served.model, prompt=PROMPT, stop=[stop],
                                             **GREEDY)
        assert s.choices[0].finish_reason == "stop"
        assert s.choices[0].text == full[:full.find(stop)], stop


def test_chat_template_errors_are_400(served: Served) -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    try:
        served.ref.apply_chat_template(bad, tokenize=False, add_generation_prompt=True)
        raises = False
    except Exception:
        raises = True
    if not raises:
        r = served.client.chat.completions.create(model=served.model, messages=bad,  # type: ignore[arg-type]
                                                  max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        return
    with pytest.raises(openai.BadRequestError) as err:
        served.client.chat.completions.create(model=served.model, messages=bad,  # type: ignore[arg-type]
                                              max_tokens=2)
    assert "chat template" in str(err.value)
    assert_baseline(served.server.metrics())


def test_tokenize_is_the_checkpoints_tokenizer_and_detokenize_round_trips(served: Served) -> None:
    with served.server.client() as c:
        def tokenize(**body: Any) -> list[int]:
            r = c.post("/tokenize", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 1024
            return list(answer["tokens"])

        assert tokenize(prompt=PROMPT) == served.ref.encode(PROMPT)
        assert tokenize(prompt=PROMPT, add_special_tokens=False) == served.ref.encode(
            PROMPT, add_special_tokens=False)
        bare = served.ref.encode(PROMPT, add_special_tokens=False)
        back = c.post("/detokenize", json={"tokens": tokenize(prompt=PROMPT)}).json()["prompt"]
        assert back == served.ref.decode(served.ref.encode(PROMPT), skip_special_tokens=True)
        assert c.post("/detokenize", json={"tokens": bare}).json()["prompt"] == served.ref.decode(
            bare)
        if served.ref.chat_template is None:
            r = c.post("/tokenize", json={"messages": MESSAGES})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
            return
        messages = MESSAGES if served.name != "gemma" else MESSAGES[1:]
        for generation in (True, False):
            expected = served.ref.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                      add_generation_prompt=generation)
            assert tokenize(messages=messages, add_generation_prompt=generation) == expected


WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}}
# How each family's template has the model begin a call (Hermes' when it teaches none).
CALL_STARTS = {"llama3": '{"name": ', "spm": "[TOOL_CALLS]["}


def test_forced_tool_calls_in_the_familys_format(served: Served) -> None:
    """The tools offered through the family's template, as transformers renders them, and a
    forced call written in the format that template teaches (the daemon's Welcome says which),
    its arguments valid under the real vocabulary's tokens."""
    if served.ref.chat_template is None:
        pytest.skip(f"{served.name} ships no chat template")
    messages: Any = [{"role": "user", "content": "Weather in Paris?"}]
    prompt_ids = served.ref.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
    r = served.client.chat.completions.create(
        model=served.model, messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
        max_tokens=120, seed=1, extra_body={"return_token_ids": True})
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt_ids)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    written = served.ref.decode(token_ids(choice), skip_special_tokens=True)
    assert written.startswith(CALL_STARTS.get(served.name, "<tool_call>\n")), written
