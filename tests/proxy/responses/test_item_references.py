"""item_reference input items resolved from the store's answer: an input item as stored, an
output item picked from the response that holds it; a 400 naming input[i].id otherwise; every
reference of a request in one op, and at most MAX_REFERENCES of them."""

import asyncio
from typing import Any

import msgspec
import pytest

from ipc.reasons import Reason
from ipc.records import Usage
from ipc.response_records import ItemsLookup, ResponseReply, ResponseStatus, StoredResponse
from proxy.http.errors import ApiError
from proxy.http.tenancy import Who
from proxy.responses.input_items import FunctionCallItem, ItemReference, MessageItem, OutputText
from proxy.responses.item_references import MAX_REFERENCES, resolve_references

STEM = "0123456789abcdef0123456789abcdef"
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_mine"}
STORED = StoredResponse(f"resp_{STEM}", ResponseStatus.COMPLETED, 1, "tiny", False,
                        output_text="hello", usage=Usage(1, 1))


class Store:
    """The engine's side of an ITEMS op, as the daemon answers it: what it holds of the ids."""

    def __init__(self, reason: Reason | None = None) -> None:
        self.reason = reason
        self.ops: list[dict[str, Any]] = []

    async def response_op(self, lookup: ItemsLookup, **fields: Any) -> ResponseReply:
        assert isinstance(lookup, ItemsLookup)
        self.ops.append({"item_ids": lookup.item_ids, **fields})
        if self.reason is not None:
            return ResponseReply("x", self.reason, message="the store is gone")
        ids = [i for i in lookup.item_ids if i == "fc_mine"]
        outputs = [STORED] if any(STEM in i for i in lookup.item_ids) else []
        return ResponseReply("x", input_items=msgspec.json.encode([CALL] * len(ids)).decode(),
                             item_ids=ids, responses=outputs)


def _resolve(*ids: str, store: Store | None = None) -> Any:
    items = [MessageItem("user", "hi"), *[ItemReference(i) for i in ids]]
    return asyncio.run(resolve_references(store or Store(), items,  # type: ignore[arg-type]
                                          Who("t", "c")))


def test_input_and_output_items_replace_their_references() -> None:
    store = Store()
    assert _resolve("fc_mine", f"msg_{STEM}", "fc_mine", store=store) == [
        MessageItem("user", "hi"), FunctionCallItem("c1", "f", "{}", id="fc_mine"),
        MessageItem("assistant", [OutputText("hello", annotations=msgspec.Raw(b"[]"))],
                    f"msg_{STEM}", "completed"), FunctionCallItem("c1", "f", "{}", id="fc_mine")]
    # One op for all of them, each id once, under the caller's tenant.
    assert store.ops == [{"who": Who("t", "c"), "item_ids": ["fc_mine", f"msg_{STEM}"]}]


@pytest.mark.parametrize("item_id", ["fc_unknown", f"fc_{STEM}_0"])  # (its output has no call)
def test_an_id_the_store_does_not_hold_is_a_400_naming_it(item_id: str) -> None:
    with pytest.raises(ApiError) as info:
        _resolve("fc_mine", item_id)
    assert (info.value.status, info.value.param) == (400, "input[2].id")
    assert item_id in info.value.message


def test_a_store_that_fails_says_so() -> None:
    with pytest.raises(ApiError) as info:
        _resolve("fc_down", store=Store(Reason.STORE_ERROR))
    assert (info.value.status, info.value.message) == (500, "the store is gone")


def test_more_references_than_the_bound_are_a_400_naming_it_and_never_asked() -> None:
    store = Store()
    with pytest.raises(ApiError) as info:
        _resolve(*[f"fc_{i}" for i in range(MAX_REFERENCES + 1)], store=store)
    assert (info.value.status, info.value.param) == (400, "input")
    assert str(MAX_REFERENCES) in info.value.message
    assert store.ops == []
