"""The Responses API's ``item_reference`` input items, each resolved from the store to the item
it names before the input is read: an input item of a stored response, by the id it is listed
under, or an output item (a message, a function call), built as a GET of its response lists it.
The store holds them or the request is a 400 naming ``input[i].id``, as OpenAI answers: an id a
client chose resolves only when a stored response holds an item under it."""

from __future__ import annotations

import asyncio

import msgspec

from ipc.response_records import ResponseOpKind, ResponseReply
from proxy.engine_client import EngineClient
from proxy.errors import ApiError
from proxy.input_items import InputItem, ItemReference, decode_stored
from proxy.responses_events import stored_object

_one = msgspec.json.Decoder(list[msgspec.Raw])


async def resolve_references(engine: EngineClient, input: str | list[InputItem | ItemReference]
                             ) -> str | list[InputItem]:
    """The input with each reference replaced by the item it names."""
    if isinstance(input, str):
        return input
    refs = {i: item.id for i, item in enumerate(input) if isinstance(item, ItemReference)}
    replies = await asyncio.gather(*[engine.response_op(ResponseOpKind.ITEM, "", item_id=item_id)
                                     for item_id in refs.values()])
    found = {i: _item(reply, item_id, f"input[{i}]")
             for (i, item_id), reply in zip(refs.items(), replies, strict=True)}
    return [found[i] if isinstance(item, ItemReference) else item
            for i, item in enumerate(input)]


def _item(reply: ResponseReply, item_id: str, where: str) -> InputItem:
    if reply.status == 200 and reply.input_items is not None:
        return decode_stored(bytes(_one.decode(reply.input_items)[0]), where)
    if reply.status == 200 and reply.response is not None:
        for item in stored_object(reply.response)["output"]:
            if item.get("id") == item_id:
                return decode_stored(msgspec.json.encode(item), where)
    if reply.status in (200, 404):
        raise ApiError(400, f"Item with id '{item_id}' not found.", param=f"{where}.id",
                       code="invalid_value")
    raise ApiError(reply.status, reply.message or f"item lookup failed ({reply.status})")
