"""The OpenAI Conversations API: conversations and their items, kept by the daemon's store.

Every route is one CONVERSATION_* ResponseOp (on the requests pipe, since items can be as big as
a Submit's) and its reply. Items are validated as the Responses API validates its input items
(proxy/responses/input_items.py) and go to the store as the same JSON, with the messages each renders as,
so a conversation's history is rendered without reading its items again. Ids are the server's:
``conv_…`` for a conversation, and for an item sent without an id the daemon makes one.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ipc.response_records import (
    ConversationCreate,
    ConversationDelete,
    ConversationGet,
    ConversationItemDelete,
    ConversationItemGet,
    ConversationItems,
    ConversationItemsAdd,
    ConversationItemsList,
    ConversationRequest,
    ConversationUpdate,
    ResponseReply,
    StoredConversation,
)
from proxy.bodies import REQUEST_ID_PATTERN, decode_body, new_id
from proxy.engine.client import EngineClient
from proxy.http.errors import ApiError, refused
from proxy.http.tenancy import who
from proxy.responses.input_items import (
    MAX_ITEM_ID,
    decode_items,
    listed_items,
    stored_items,
    to_messages,
)
from proxy.responses.request import Metadata
from proxy.responses.routes import item_list, items_page

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's bound on the items of one create or append

# Each item decoded on its own, as the Responses API's input (a message may leave out its type).
Items = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_ITEMS_PER_REQUEST)]
_ID = re.compile(REQUEST_ID_PATTERN)


class CreateConversation(msgspec.Struct, forbid_unknown_fields=True):
    items: Items | None = None
    metadata: Metadata | None = None


class UpdateConversation(msgspec.Struct, forbid_unknown_fields=True):
    metadata: Metadata


class AddItems(msgspec.Struct, forbid_unknown_fields=True):
    items: Annotated[Items, msgspec.Meta(min_length=1)]


def conversation_items(raws: list[msgspec.Raw]) -> ConversationItems:
    """Items as the store keeps them, each with the messages it renders as."""
    items = decode_items(raws, "items")
    return ConversationItems(stored_items(items), [to_messages([item]) for item in items])


def conversation_object(stored: StoredConversation) -> dict[str, Any]:
    return {"id": stored.id, "object": "conversation", "created_at": stored.created_at,
            "metadata": stored.metadata}


def check_conversation_id(cid: str, param: str = "conversation_id") -> str:
    """An id no conversation can have is a 404 here (as OpenAI answers), not a trip to the
    daemon."""
    if not _ID.match(cid):
        shown = cid if len(cid) <= 64 else cid[:64] + "..."
        raise ApiError(404, f"Conversation with id '{shown}' not found.", param=param,
                       code="not_found")
    return cid


async def _op(request: Request, op: ConversationRequest) -> ResponseReply:
    engine: EngineClient = request.app.state.engine
    reply = await engine.response_op(op, who=who(request))
    if reply.reason is not None:
        raise refused(reply.reason, reply.message or "conversation operation failed",
                      reply.param)
    return reply


def _conversation(reply: ResponseReply) -> Response:
    assert reply.conversation is not None
    return JSONResponse(conversation_object(reply.conversation))


def _no_include(request: Request) -> None:
    # The openai client writes a list as include[]=...
    if any(request.query_params.getlist(k) for k in ("include", "include[]")):
        raise ApiError(400, "'include' is not supported: items are listed as stored",
                       param="include", code="unsupported_parameter")


def _path_ids(request: Request) -> tuple[str, str]:
    cid = check_conversation_id(request.path_params["conversation_id"])
    item_id = request.path_params["item_id"]
    if len(item_id) > MAX_ITEM_ID:
        raise ApiError(404, f"Item with id '{item_id[:64]}...' not found.", param="item_id",
                       code="not_found")
    return cid, item_id


async def create_conversation(request: Request) -> Response:
    body = await request.body()
    req = decode_body(body or b"{}", CreateConversation)
    items = conversation_items(req.items) if req.items else None
    reply = await _op(request, ConversationCreate(new_id("conv_"), items, req.metadata or {}))
    return _conversation(reply)


async def get_conversation(request: Request) -> Response:
    cid = check_conversation_id(request.path_params["conversation_id"])
    return _conversation(await _op(request, ConversationGet(cid)))


async def update_conversation(request: Request) -> Response:
    cid = check_conversation_id(request.path_params["conversation_id"])
    req = decode_body(await request.body(), UpdateConversation)
    return _conversation(await _op(request, ConversationUpdate(cid, req.metadata)))


async def delete_conversation(request: Request) -> Response:
    cid = check_conversation_id(request.path_params["conversation_id"])
    await _op(request, ConversationDelete(cid))
    return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})


async def list_items(request: Request) -> Response:
    cid = check_conversation_id(request.path_params["conversation_id"])
    _no_include(request)
    page = items_page(request.query_params, f"no item of conversation {cid!r}")
    return item_list(await _op(request, ConversationItemsList(cid, page)))


async def add_items(request: Request) -> Response:
    cid = check_conversation_id(request.path_params["conversation_id"])
    _no_include(request)
    req = decode_body(await request.body(), AddItems)
    items = conversation_items(req.items)
    reply = await _op(request, ConversationItemsAdd(cid, items))
    # The daemon answers with the ids it listed them under: the items are ours already.
    return item_list(msgspec.structs.replace(reply, input_items=items.items))


async def get_item(request: Request) -> Response:
    cid, item_id = _path_ids(request)
    _no_include(request)
    reply = await _op(request, ConversationItemGet(cid, item_id))
    listed = listed_items(reply.input_items or "[]", reply.item_ids)
    return Response(listed[1:-1], media_type="application/json")  # the list's one item


async def delete_item(request: Request) -> Response:
    """Answers with the conversation, as OpenAI does."""
    cid, item_id = _path_ids(request)
    return _conversation(await _op(request, ConversationItemDelete(cid, item_id)))


routes = [
    Route("/v1/conversations", create_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", get_conversation, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}", update_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items", add_items, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", get_item, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", delete_item,
          methods=["DELETE"]),
]
