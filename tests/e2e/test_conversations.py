"""The Conversations API through the official openai client against the real pair: CRUD, turns
that append on completion only, a dropped turn that changes nothing, one turn at a time."""

from __future__ import annotations

import openai
import pytest

from tests.support.metrics import m
from tests.support.pair import (
    Server,
    assert_baseline,
    check_abort_figures,
    drop,
    post_raw,
    wait_running,
)
from tests.support.raw_http import read_events, response_id_from_stream
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

LONG = {"max_output_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(abort_server: Server) -> Server:
    """builtin:small's ticks (~50 ms): a long turn is still running when it is dropped."""
    return abort_server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def texts(client: openai.OpenAI, cid: str) -> list[str]:
    items = client.conversations.items.list(cid, order="asc", limit=100)
    return [part.text for item in items.data for part in item.content]  # type: ignore[union-attr]


def test_create_turn_list_append_delete(client: openai.OpenAI, server: Server) -> None:
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "hello"}], metadata={"topic": "t"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "t"}
    assert client.conversations.retrieve(conv.id).id == conv.id
    updated = client.conversations.update(conv.id, metadata={"topic": "u"})
    assert updated.metadata == {"topic": "u"}

    first = client.responses.create(input="and then?", conversation=conv.id, max_output_tokens=8)
    assert first.status in ("completed", "incomplete") and first.conversation is not None
    assert first.conversation.id == conv.id
    second = client.responses.create(input="go on", conversation={"id": conv.id},
                                     max_output_tokens=8)
    # Turn 2 is rendered after turn 1's history: its prompt is longer by at least turn 1.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert texts(client, conv.id) == ["hello", "and then?", first.output_text, "go on",
                                      second.output_text]
    listed = client.conversations.items.list(conv.id, limit=2)  # newest first
    assert listed.has_more and listed.data[0].id == second.output[0].id
    assert client.responses.retrieve(second.id).conversation.id == conv.id  # type: ignore[union-attr]

    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "more"}])
    item_id = added.data[0].id
    assert client.conversations.items.retrieve(item_id, conversation_id=conv.id).id == item_id
    assert texts(client, conv.id)[-1] == "more"
    assert client.conversations.items.delete(item_id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(item_id, conversation_id=conv.id)
    metrics = server.metrics()
    assert m(metrics, "tether_conversations") >= 1
    assert m(metrics, "tether_conversation_items") >= 5

    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    for call in (lambda: client.conversations.retrieve(conv.id),
                 lambda: client.conversations.items.list(conv.id),
                 lambda: client.responses.create(input="x", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_conversation_with_previous_response_id_is_400(client: openai.OpenAI) -> None:
    conv = client.conversations.create()
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(input="x", conversation=conv.id, previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="include"):
        client.conversations.items.list(conv.id, include=["message.output_text.logprobs"])


def test_a_dropped_streaming_turn_changes_nothing(client: openai.OpenAI, server: Server) -> None:
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "hello"}])
    before = server.metrics()
    sock = post_raw(server, "/v1/responses", {"input": "talk to me", "stream": True,
                                              "conversation": conv.id, **LONG})
    rid = response_id_from_stream(read_events(sock, 8))
    assert m(server.metrics(), "tether_conversation_placeholders") == 1
    drop(sock)
    after = check_abort_figures(server, before)
    assert_baseline(after)
    assert texts(client, conv.id) == ["hello"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
    # The claim went with it: the next turn runs.
    nxt = client.responses.create(input="again", conversation=conv.id, max_output_tokens=4)
    assert texts(client, conv.id) == ["hello", "again", nxt.output_text]


def test_a_second_turn_while_one_runs_is_409(client: openai.OpenAI, server: Server) -> None:
    conv = client.conversations.create()
    sock = post_raw(server, "/v1/responses", {"input": "long", "stream": True,
                                              "conversation": conv.id, **LONG})
    rid = response_id_from_stream(read_events(sock, 3))
    with pytest.raises(openai.ConflictError, match=rid):
        client.responses.create(input="meanwhile", conversation=conv.id, max_output_tokens=4)
    drop(sock)
    wait_for(lambda: m(server.metrics(), "tether_requests_running") == 0, 30, "the drop")
    assert texts(client, conv.id) == []


def test_a_cancelled_background_turn_changes_nothing(client: openai.OpenAI,
                                                     server: Server) -> None:
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "hello"}])
    run = client.responses.create(input="in the background", conversation=conv.id,
                                  background=True, max_output_tokens=1500, temperature=0,
                                  extra_body={"ignore_eos": True})
    wait_running(server)
    assert client.responses.cancel(run.id).status == "cancelled"
    wait_for(lambda: m(server.metrics(), "tether_requests_running") == 0, 30, "the cancel")
    assert texts(client, conv.id) == ["hello"]
    done = client.responses.create(input="now", conversation=conv.id, background=True,
                                   max_output_tokens=4)
    wait_for(lambda: client.responses.retrieve(done.id).status in ("completed", "incomplete"),
             30, "the turn")
    assert texts(client, conv.id)[1] == "now" and len(texts(client, conv.id)) == 3
