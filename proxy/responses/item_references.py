"""The Responses API's ``item_reference`` input items, each resolved from the store to the item
it names before the input is read: an input item of a stored response, by the id it is listed
under, or an output item (a message, a function call), built as a GET of its response lists it.
The store holds them or the request is a 400 naming ``input[i].id``, as OpenAI answers: an id a
client chose resolves only when one of its own tenant's stored responses holds an item under
it, and an id of the server's making only within the response it names
(daemon/responses/item_index.py).

A request names at most MAX_REFERENCES items, and all of them go to the daemon as one operation:
however many a client sends, it costs the store's queue one place.
"""

from __future__ import annotations

import msgspec

from ipc.response_records import ItemsLookup, ResponseReply
from proxy.engine.client import EngineClient
from proxy.http.errors import ApiError, refused
from proxy.http.tenancy import ANYONE, Who
from proxy.responses.events import stored_object
from proxy.responses.input_items import InputItem, ItemReference, decode_stored

MAX_REFERENCES = 100

_items = msgspec.json.Decoder(list[msgspec.Raw])


async def resolve_references(engine: EngineClient, input: str | list[InputItem | ItemReference],
                             who: Who = ANYONE) -> str | list[InputItem]:
    """The input with each reference replaced by the item it names."""
    if isinstance(input, str):
        return input
    refs = {i: item.id for i, item in enumerate(input) if isinstance(item, ItemReference)}
    if not refs:
        return input  # type: ignore[return-value]  # no reference: only InputItems
    if len(refs) > MAX_REFERENCES:
        raise ApiError(400, f"input holds {len(refs)} item references; a request may hold at "
                       f"most {MAX_REFERENCES}", param="input", code="too_many_references")
    reply = await engine.response_op(ItemsLookup(list(dict.fromkeys(refs.values()))), who=who)
    if reply.reason is not None:
        raise refused(reply.reason, reply.message or "item lookup failed", reply.param)
    found = _found(reply)
    out: list[InputItem] = []
    for i, item in enumerate(input):
        if not isinstance(item, ItemReference):
            out.append(item)
        elif item.id in found:
            out.append(decode_stored(found[item.id], f"input[{i}]"))
        else:
            raise ApiError(400, f"Item with id '{item.id}' not found.", param=f"input[{i}].id",
                           code="invalid_value")
    return out


def _found(reply: ResponseReply) -> dict[str, bytes]:
    """Each item the store answered with, as JSON, by its id: the input items as stored, the
    output items of the responses as a GET lists them."""
    found = {item_id: bytes(raw) for item_id, raw in
             zip(reply.item_ids, _items.decode(reply.input_items or "[]"), strict=True)}
    for stored in reply.responses:
        for item in stored_object(stored)["output"]:
            if isinstance(item.get("id"), str):
                found.setdefault(item["id"], msgspec.json.encode(item))
    return found
