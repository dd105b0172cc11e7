"""item_reference input items resolved from the store's answer: an input item as stored, an
output item picked from the response that holds it; a 400 naming input[i].id otherwise."""

import asyncio
from typing import Any

import msgspec
import pytest

from ipc.records import Usage
from ipc.response_records import ResponseOpKind, ResponseReply, ResponseStatus, StoredResponse
from proxy.errors import ApiError
from proxy.input_items import FunctionCallItem, ItemReference, MessageItem, OutputText
from proxy.item_references import resolve_references

STEM = "0123456789abcdef0123456789abcdef"
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_mine"}
STORED = StoredResponse(f"resp_{STEM}", ResponseStatus.COMPLETED, 1, "tiny", False,
                        output_text="hello", usage=Usage(1, 1))


class Store:
    """The engine's side of an ITEM op, as the daemon answers it."""

    def __init__(self, replies: dict[str, ResponseReply]) -> None:
        self.replies = replies

    async def response_op(self, op: ResponseOpKind, response_id: str, **fields: Any
                          ) -> ResponseReply:
        assert op is ResponseOpKind.ITEM
        return self.replies.get(fields["item_id"], ResponseReply("x", 404, message="none"))


REPLIES = {"fc_mine": ResponseReply("x", 200, input_items=msgspec.json.encode([CALL]).decode()),
           f"msg_{STEM}": ResponseReply("x", 200, response=STORED),
           f"fc_{STEM}_0": ResponseReply("x", 200, response=STORED),
           "fc_down": ResponseReply("x", 500, message="the store is gone")}


def _resolve(*ids: str) -> Any:
    items = [MessageItem("user", "hi"), *[ItemReference(i) for i in ids]]
    return asyncio.run(resolve_references(Store(REPLIES), items))  # type: ignore[arg-type]


def test_input_and_output_items_replace_their_references() -> None:
    assert _resolve("fc_mine", f"msg_{STEM}") == [
        MessageItem("user", "hi"), FunctionCallItem("c1", "f", "{}", id="fc_mine"),
        MessageItem("assistant", [OutputText("hello", annotations=msgspec.Raw(b"[]"))],
                    f"msg_{STEM}", "completed")]


@pytest.mark.parametrize("item_id", ["fc_unknown", f"fc_{STEM}_0"])  # (its output has no call)
def test_an_id_the_store_does_not_hold_is_a_400_naming_it(item_id: str) -> None:
    with pytest.raises(ApiError) as info:
        _resolve("fc_mine", item_id)
    assert (info.value.status, info.value.param) == (400, "input[2].id")
    assert item_id in info.value.message


def test_a_store_that_fails_says_so() -> None:
    with pytest.raises(ApiError) as info:
        _resolve("fc_down")
    assert (info.value.status, info.value.message) == (500, "the store is gone")
