"""One client's stored things are its own (issue 34, items 16 and 17), on the real pair with two
API keys and the official openai client:

- retention is bounded fairly between keys: one key's flood of responses or conversations past
  the store's bounds evicts none of another key's, which holds less than its share;
- an item_reference resolves to what its owner stored: an item planted under another
  response's output id never stands in for that output, and another key's items are not
  found at all (without keys, every client is one tenant, and the first still holds).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.pair import Server, start_server
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

KEYS = ("key-victim", "key-other")
MAX_RESPONSES = 8
MAX_CONVERSATIONS = 3


def _served(factory: pytest.TempPathFactory, extra: list[str],
            api_key: str | None = None) -> Iterator[Server]:
    s = start_server(factory.mktemp("tenants"), ["--model", "sim:0", *extra], api_key=api_key)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _served(tmp_path_factory, [
        "--api-key", KEYS[1], "--replica-lease-s", "0.6",
        "--response-store-max", str(MAX_RESPONSES),
        "--conversation-store-max", str(MAX_CONVERSATIONS)], api_key=KEYS[0])


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Without keys: every client is one tenant."""
    yield from _served(tmp_path_factory, [])


def _client(server: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _referenced_text(client: openai.OpenAI, item_id: str) -> Any:
    """The text of the item `item_id` names, as a new response stores it from the reference
    (a 400 if the store does not find it for this client)."""
    made = client.responses.create(model="sim:0", max_output_tokens=1, input=[
        {"type": "item_reference", "id": item_id}, {"role": "user", "content": "go on"}])
    first = client.responses.input_items.list(made.id, order="asc").data[0]
    return first.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("keyed", [True, False], ids=["two keys", "no keys"])
def test_an_item_planted_under_another_responses_output_id_is_never_found(
        server: Server, open_server: Server, keyed: bool) -> None:
    victim = _client(server, KEYS[0]) if keyed else _client(open_server)
    other = _client(server, KEYS[1]) if keyed else _client(open_server)
    answer = victim.responses.create(model="sim:0", input="a question", max_output_tokens=4)
    output_id = answer.output[0].id
    assert output_id.startswith("msg_")
    # Another client, which learned the response's id, stores text under its output's id.
    other.responses.create(model="sim:0", max_output_tokens=1, input=[
        {"type": "message", "role": "assistant", "content": "PLANTED", "id": output_id},
        {"role": "user", "content": "hi"}])
    assert _referenced_text(victim, output_id) == answer.output_text


def test_a_key_reaches_only_its_own_items(server: Server) -> None:
    victim, other = _client(server, KEYS[0]), _client(server, KEYS[1])
    victim.responses.create(model="sim:0", max_output_tokens=1, input=[
        {"role": "user", "content": "mine", "id": "item_shared"}])
    other.responses.create(model="sim:0", max_output_tokens=1, input=[
        {"role": "user", "content": "PLANTED", "id": "item_shared"}])  # newer
    assert _referenced_text(victim, "item_shared") == "mine"
    assert _referenced_text(other, "item_shared") == "PLANTED"
    victim.responses.create(model="sim:0", max_output_tokens=1, input=[
        {"role": "user", "content": "secret", "id": "item_victims_own"}])
    with pytest.raises(openai.BadRequestError) as info:
        _referenced_text(other, "item_victims_own")
    assert info.value.body["param"] == "input[0].id"  # type: ignore[index]


def test_one_keys_flood_evicts_none_of_anothers(server: Server) -> None:
    victim, other = _client(server, KEYS[0]), _client(server, KEYS[1])
    kept = victim.responses.create(model="sim:0", input="keep me", max_output_tokens=2)
    conversation = victim.conversations.create()
    flood = [other.responses.create(model="sim:0", input=f"flood {i}", max_output_tokens=1).id
             for i in range(3 * MAX_RESPONSES)]
    floods = [other.conversations.create().id for _ in range(3 * MAX_CONVERSATIONS)]

    def pruned() -> bool:  # one pass prunes all it prunes, in one transaction
        try:
            other.responses.retrieve(flood[0])
        except openai.NotFoundError:
            try:
                other.conversations.retrieve(floods[0])
            except openai.NotFoundError:
                return True
        return False

    wait_for(pruned, 30, "the flood's oldest response and conversation pruned")
    assert victim.responses.retrieve(kept.id).output_text == kept.output_text
    assert victim.conversations.retrieve(conversation.id).id == conversation.id
    went_on = victim.responses.create(model="sim:0", input="and?", previous_response_id=kept.id,
                                      max_output_tokens=1)
    assert went_on.status in ("completed", "incomplete")
    assert other.responses.retrieve(flood[-1]).id == flood[-1]  # its newest stay
