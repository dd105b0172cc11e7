"""The records of the daemon's Responses and Conversations store, on the wire.

A Submit of kind RESPONSE carries its ResponseFields (ipc/records.py); everything else the store
is asked goes as a ResponseOp around one request, a record of its own for each kind (GET,
DELETE, cancel and input items of a stored response on the control pipe; the items a request's
references name and the conversations' requests on the requests pipe, as they can be big), and
is answered by one ResponseReply on the tokens pipe, carrying a StoredResponse or a
StoredConversation.

Every op names its ``tenant`` (whose stored things it may reach: the API key's tag, "" without
keys) and its ``client`` (whose turn it waits for in the daemon's queue), and the moment past
which the daemon must not apply it (``deadline``): the proxy has stopped waiting by then, so an
op answered "not applied" never was, and a client's retry stores once.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

from ipc.reasons import Reason
from ipc.records import Kind, Message, PosInt, ToolCallFormat, Usage


class ResponseStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INCOMPLETE = "incomplete"


# Why a response is incomplete, beside OpenAI's reasons ("max_output_tokens", ...): the server
# stopped before it finished (a background response, stored with what it had).
SHUTDOWN_REASON = "server_shutdown"

# A placeholder is a stored response whose session has not ended yet.
PLACEHOLDER_STATUSES = frozenset({ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS})


class ResponseOpKind(enum.StrEnum):
    """What a ResponseOp asks: the wire tag of its request (``op``)."""

    GET = "get"
    DELETE = "delete"
    CANCEL = "cancel"
    INPUT_ITEMS = "input_items"
    ITEMS = "items"
    CONVERSATION_CREATE = "conv_create"
    CONVERSATION_GET = "conv_get"
    CONVERSATION_UPDATE = "conv_update"
    CONVERSATION_DELETE = "conv_delete"
    CONVERSATION_ITEMS = "conv_items"
    CONVERSATION_ADD_ITEMS = "conv_add_items"
    CONVERSATION_ITEM_GET = "conv_item_get"
    CONVERSATION_ITEM_DELETE = "conv_item_delete"


class ItemsPage(msgspec.Struct, frozen=True):
    """Which of a stored response's input items an INPUT_ITEMS op asks for: OpenAI's list
    parameters, checked by the proxy (``after`` is an item id, so it is short)."""

    limit: PosInt = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


class ConversationItems(msgspec.Struct, frozen=True):
    """Items to add to a conversation: as the proxy validated them (JSON text of a list of
    objects, stored as they are) and the messages each renders as in a prompt."""

    items: str
    messages: list[list[Message]]


# --- what an op asks: one record a kind, tagged by ``op`` -------------------------------------

_K = ResponseOpKind


class _Request(msgspec.Struct, frozen=True, tag_field="op"):
    pass


class ResponseGet(_Request, frozen=True, tag=_K.GET.value):
    response_id: str


class ResponseDelete(_Request, frozen=True, tag=_K.DELETE.value):
    response_id: str


class ResponseCancel(_Request, frozen=True, tag=_K.CANCEL.value):
    response_id: str


class ResponseInputItems(_Request, frozen=True, tag=_K.INPUT_ITEMS.value):
    """A page of a stored response's input items."""

    response_id: str
    page: ItemsPage = ItemsPage()


class ItemsLookup(_Request, frozen=True, tag=_K.ITEMS.value):
    """The items of stored responses that a request's item_references name, all at once."""

    item_ids: list[str]


class ConversationCreate(_Request, frozen=True, tag=_K.CONVERSATION_CREATE.value):
    conversation_id: str  # made by the proxy
    items: ConversationItems | None = None
    metadata: dict[str, str] = {}


class ConversationGet(_Request, frozen=True, tag=_K.CONVERSATION_GET.value):
    conversation_id: str


class ConversationUpdate(_Request, frozen=True, tag=_K.CONVERSATION_UPDATE.value):
    conversation_id: str
    metadata: dict[str, str]


class ConversationDelete(_Request, frozen=True, tag=_K.CONVERSATION_DELETE.value):
    conversation_id: str


class ConversationItemsList(_Request, frozen=True, tag=_K.CONVERSATION_ITEMS.value):
    """A page of a conversation's items."""

    conversation_id: str
    page: ItemsPage = ItemsPage()


class ConversationItemsAdd(_Request, frozen=True, tag=_K.CONVERSATION_ADD_ITEMS.value):
    conversation_id: str
    items: ConversationItems


class ConversationItemGet(_Request, frozen=True, tag=_K.CONVERSATION_ITEM_GET.value):
    conversation_id: str
    item_id: str


class ConversationItemDelete(_Request, frozen=True, tag=_K.CONVERSATION_ITEM_DELETE.value):
    conversation_id: str
    item_id: str


ResponseRequest = ResponseGet | ResponseDelete | ResponseCancel | ResponseInputItems
ConversationRequest = (ConversationCreate | ConversationGet | ConversationUpdate
                       | ConversationDelete | ConversationItemsList | ConversationItemsAdd
                       | ConversationItemGet | ConversationItemDelete)
StoreRequest = ResponseRequest | ItemsLookup | ConversationRequest
# Requests that can be bigger than a control record (PIPE_BUF): they go on the requests pipe.
REQUESTS_PIPE = (ItemsLookup, ConversationCreate, ConversationGet, ConversationUpdate,
                 ConversationDelete, ConversationItemsList, ConversationItemsAdd,
                 ConversationItemGet, ConversationItemDelete)


class ResponseOp(msgspec.Struct, tag=Kind.RESPONSE_OP.value, tag_field="k"):
    """One request to the store (``request``: GET / DELETE / cancel of a stored response, a
    page of its input items, the items a request references, or an operation on a
    conversation), and how it waits in the daemon's queue; answered by a ResponseReply with
    ``op_id``."""

    op_id: str
    request: StoreRequest
    epoch: int = 0
    tenant: str = ""  # whose stored things it reaches (the API key's tag; "" without keys)
    client: str = ""  # whose turn it waits for in the daemon's queue
    # CLOCK_MONOTONIC (one clock for both processes): past it the proxy no longer waits, and
    # the daemon answers without applying the op.
    deadline: float | None = None

    @property
    def kind(self) -> ResponseOpKind:
        return ResponseOpKind(str(self.request.__struct_config__.tag))

    @property
    def subject(self) -> str:
        """The response or conversation it is about ("" for a lookup)."""
        request = self.request
        if isinstance(request, ItemsLookup):
            return ""
        if isinstance(request, ResponseGet | ResponseDelete | ResponseCancel
                      | ResponseInputItems):
            return request.response_id
        return request.conversation_id


class StoredResponse(msgspec.Struct, frozen=True):
    """A stored response as its row holds it; the proxy builds the API object from it."""

    id: str
    status: ResponseStatus
    created_at: int
    model: str
    background: bool
    completed_at: float | None = None
    output_text: str | None = None  # None: no output yet (queued, in progress)
    usage: Usage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    error: str | None = None  # why it failed
    incomplete_reason: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tool_call_format: ToolCallFormat | None = None  # the output holds tool calls in this format
    conversation: str | None = None  # the conversation it is a turn of
    echo: str = "{}"  # ResponseFields.echo, as stored


class StoredConversation(msgspec.Struct, frozen=True):
    id: str
    created_at: int
    metadata: dict[str, str] = {}


class ResponseReply(msgspec.Struct, tag=Kind.RESPONSE_REPLY.value, tag_field="k"):
    """The answer to a ResponseOp: done (no `reason`), the response (GET, CANCEL), one page of its
    input items (INPUT_ITEMS: the page's items as stored, JSON text of a list, with the id each
    is listed under), ``deleted`` (DELETE) or, for ITEMS, the input items found (in
    ``input_items`` and ``item_ids``) and the responses whose output holds the others
    (``responses``); for a conversation, ``conversation`` or its items in the same fields; else
    why it was refused (``reason``, which the proxy turns into a status: proxy/http/errors.py), in
    ``message``, and the ``param`` at fault."""

    op_id: str
    reason: Reason | None = None
    response: StoredResponse | None = None
    conversation: StoredConversation | None = None
    input_items: str | None = None
    item_ids: list[str] = []
    responses: list[StoredResponse] = []  # ITEMS: the responses output ids name
    has_more: bool = False  # more items follow the page
    deleted: bool = False
    message: str | None = None
    param: str | None = None
