"""A page of a stored response's input items: only the page travels, in the order asked for,
each item as stored, with the id it is listed under."""

import msgspec
import pytest

from daemon.responses.items import PAGE_BYTES, page_of
from ipc.response_records import ItemsPage

# As earlier releases stored them too: the client's own fields, ids only where it gave one.
STORED = msgspec.json.encode([
    {"role": "system", "content": "rules"},
    {"type": "message", "role": "user", "id": "msg_mine", "content": [
        {"type": "input_text", "text": "one"}]},
    {"role": "assistant", "content": "ONE", "id": ""},
    {"role": "user", "content": "two", "extra": {"kept": "as stored"}},
]).decode()
IDS = ["msg_abc_0", "msg_mine", "msg_abc_2", "msg_abc_3"]


def test_items_without_an_id_are_listed_under_one_derived_from_their_position() -> None:
    page = page_of("resp_abc", STORED, ItemsPage(limit=100, order="asc"))
    assert page is not None and page.ids == IDS and not page.has_more
    assert msgspec.json.decode(page.items) == msgspec.json.decode(STORED)


def test_newest_first_by_default_and_only_the_page_travels() -> None:
    page = page_of("resp_abc", STORED, ItemsPage(limit=2))
    assert page is not None and page.ids == ["msg_abc_3", "msg_abc_2"] and page.has_more
    assert [i["content"] for i in msgspec.json.decode(page.items)] == ["two", "ONE"]
    rest = page_of("resp_abc", STORED, ItemsPage(limit=2, after="msg_abc_2"))
    assert rest is not None and rest.ids == ["msg_mine", "msg_abc_0"] and not rest.has_more
    last = page_of("resp_abc", STORED, ItemsPage(limit=2, after="msg_abc_0"))
    assert last is not None and last.ids == [] and last.items == "[]" and not last.has_more


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_after_may_name_an_item_by_its_own_id(order: str) -> None:
    page = page_of("resp_abc", STORED, ItemsPage(limit=1, order=order, after="msg_mine"))
    assert page is not None
    assert page.ids == (["msg_abc_2"] if order == "asc" else ["msg_abc_0"]) and page.has_more \
        == (order == "asc")


def test_after_that_names_no_item_is_none() -> None:
    assert page_of("resp_abc", STORED, ItemsPage(after="msg_abc_9")) is None
    assert page_of("resp_abc", STORED, ItemsPage(after="msg_other_0")) is None


def test_a_page_stops_short_of_its_bytes_bound_and_says_there_is_more() -> None:
    big = [{"role": "user", "content": c * (PAGE_BYTES // 3)} for c in "abc"]
    stored = msgspec.json.encode(big).decode()
    first = page_of("resp_abc", stored, ItemsPage(limit=20, order="asc"))
    assert first is not None and first.ids == ["msg_abc_0", "msg_abc_1"] and first.has_more
    assert len(first.items) <= PAGE_BYTES
    rest = page_of("resp_abc", stored, ItemsPage(limit=20, order="asc", after="msg_abc_1"))
    assert rest is not None and rest.ids == ["msg_abc_2"] and not rest.has_more
    one = page_of("resp_abc", msgspec.json.encode([{"content": "x" * PAGE_BYTES}] * 2).decode(),
                  ItemsPage(limit=20))
    assert one is not None and len(one.ids) == 1 and one.has_more  # never an empty page
