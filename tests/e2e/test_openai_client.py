"""The official openai client against the real pair: every endpoint, streaming and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.pair import Server, assert_baseline
from tests.support.raw_http import sse_json
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert model_name(client)


def test_completions_prompt_list_times_n(client: openai.OpenAI) -> None:
    r = client.completions.create(model=model_name(client), prompt=["a", "b", "c"], n=2,
                                  max_tokens=6, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 36


def test_token_ids_add_up_to_usage(server: Server) -> None:
    body = {"prompt": ["x", "y"], "n": 2, "max_tokens": 9, "ignore_eos": True,
            "return_token_ids": True}
    with server.client() as c:
        r = c.post("/v1/completions", json=body).json()
        assert [len(choice["token_ids"]) for choice in r["choices"]] == [9, 9, 9, 9]
        counted: dict[int, int] = {}
        usage: dict[str, int] = {}
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "n": 2,
                "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}) as s:
            for line in s.iter_lines():
                event = sse_json(line)
                if event and event.get("usage"):
                    usage = event["usage"]
                for choice in (event or {}).get("choices", []):
                    counted[choice["index"]] = (counted.get(choice["index"], 0)
                                                + len(choice.get("token_ids", ())))
        assert sum(counted.values()) == usage["completion_tokens"]


def test_chat_logprobs_of_the_real_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=model_name(client), max_tokens=12, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert r.usage is not None and len(content or []) == r.usage.completion_tokens == 12
    for token in content or []:
        top = [t.logprob for t in token.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert token.logprob == pytest.approx(top[0], abs=1e-5)
    stream = client.completions.create(model=model_name(client), prompt="hello", max_tokens=8,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True})
    tokens = [t for chunk in stream for c in chunk.choices if c.logprobs is not None
              for t in c.logprobs.tokens or ()]
    assert len(tokens) == 8


def test_completions_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=model_name(client), prompt="hello", max_tokens=7,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_chat_n_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=model_name(client), messages=messages,  # type: ignore[arg-type]
                                       n=3, max_tokens=5, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in r.choices)
    stream = client.chat.completions.create(model=model_name(client), messages=messages,  # type: ignore[arg-type]
                                            max_tokens=5, stream=True,
                                            extra_body={"ignore_eos": True})
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] == "length"


def test_seeded_requests_repeat(client: openai.OpenAI) -> None:
    kwargs = {"model": model_name(client), "prompt": "same seed", "max_tokens": 8, "seed": 42,
              "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(  # type: ignore[call-overload]
        **kwargs).choices[0].text


def test_responses_chain_and_crud(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(model=model_name(client), input="my name is tether",
                                    max_output_tokens=5, extra_body={"ignore_eos": True})
    assert first.status == "incomplete" or first.status == "completed"
    second = client.responses.create(model=model_name(client), input="what is my name?",
                                     previous_response_id=first.id, max_output_tokens=5,
                                     extra_body={"ignore_eos": True})
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).id == first.id
    # A response's own input, not the conversation's.
    [item] = client.responses.input_items.list(second.id).data
    assert item.content[0].text == "what is my name?"  # type: ignore[union-attr]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model_name(client), input="x", previous_response_id=first.id)
    assert_baseline(server.metrics())


def test_responses_stream_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=model_name(client), input="stream", stream=True,
                                          max_output_tokens=4, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")


def test_background_cancel(client: openai.OpenAI) -> None:
    r = client.responses.create(model=model_name(client), input="slow", background=True,
                                max_output_tokens=1500, extra_body={"ignore_eos": True})
    assert r.status in ("queued", "in_progress")
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: client.responses.retrieve(r.id).status == "cancelled", 10, "status cancelled")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ({"prompt": "x", "temperature": 9}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
])
def test_bad_parameters_are_400_naming_the_field(server: Server, body: dict[str, object],
                                                 param: str) -> None:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or param in error["message"]


def test_error_statuses(server: Server) -> None:
    with server.client() as c:
        assert c.post("/v1/completions", content=b"{nope").status_code == 400
        assert c.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        assert c.get("/v1/responses/resp_unknown").status_code == 404
        assert c.post("/v1/completions", content=b"x" * (5 * 1024 * 1024),
                      headers={"Content-Type": "application/json"}).status_code == 413
        assert c.get("/v1/nothing").status_code == 404
        r = c.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "my-id-1"})
        assert r.headers["X-Request-Id"] == "my-id-1"
