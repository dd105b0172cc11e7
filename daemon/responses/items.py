"""One page of a stored response's input items, for GET /v1/responses/{id}/input_items.

The proxy stores the items as JSON text (ResponseFields.input_items): a list of objects, each
maybe with its own ``id``. The daemon answers with the page the client asked for, never with
every item, so a reply's size follows the page; and a page ends early (``has_more``) where its
items would pass PAGE_BYTES, so that however large the items, a reply fits a frame. Of an item
it reads only the ``id``; the rest travels as stored. An item stored without an id (the proxy
never makes one up) is listed under ``msg_<the response id without resp_>_<its position>``, and
``after`` names it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ipc.response_records import ItemsPage, ResponseReply

# A page holds items of at most this many bytes together (or its first item, whatever its size):
# in a reply they travel as a JSON string, at most twice as long, well inside MAX_FRAME_BYTES.
PAGE_BYTES = 4 << 20


def within_bytes(sizes: list[int], budget: int) -> int:
    """How many of the first ``sizes`` fit ``budget`` together; at least one, if any."""
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if total > budget and n > 0:
            return n
    return len(sizes)


class _Id(msgspec.Struct):
    # Any: rows stored by earlier releases hold whatever their client sent.
    id: Any = None


_raw_items = msgspec.json.Decoder(list[msgspec.Raw])
_item_ids = msgspec.json.Decoder(list[_Id])


@dataclass(frozen=True, slots=True)
class Page:
    items: str  # JSON text of the page's items, in the page's order
    ids: list[str]  # the id each is listed under
    has_more: bool


def listed_ids(response_id: str, stored: bytes) -> list[str]:
    """The id each stored item is listed under (a conversation keeps a turn's items so)."""
    stem = response_id.removeprefix("resp_")
    return [item.id if isinstance(item.id, str) and item.id else f"msg_{stem}_{i}"
            for i, item in enumerate(_item_ids.decode(stored))]


def page_of(response_id: str, input_items: str, page: ItemsPage) -> Page | None:
    """The page of `input_items` (as stored) that `page` asks for; None when ``page.after``
    names no item of this response."""
    stored = input_items.encode()
    raws = _raw_items.decode(stored)
    ids = listed_ids(response_id, stored)
    order = list(range(len(raws)))
    if page.order == "desc":
        order.reverse()
    if page.after is not None:
        try:
            start = [ids[i] for i in order].index(page.after) + 1
        except ValueError:
            return None
        order = order[start:]
    wanted = order[:page.limit]
    chosen = wanted[:within_bytes([len(raws[i]) for i in wanted], PAGE_BYTES)]
    text = b"[" + b",".join([bytes(raws[i]) for i in chosen]) + b"]"
    return Page(text.decode(), [ids[i] for i in chosen], len(order) > len(chosen))


def items_reply(op_id: str, response_id: str, page: ItemsPage,
                input_items: str) -> ResponseReply:
    """One page of the stored items: a reply's size follows the page, not the whole input."""
    found = page_of(response_id, input_items, page)
    if found is None:
        return ResponseReply(op_id, 400, param="after", message=f"'after' names no input "
                             f"item of response {response_id!r}: {page.after!r}")
    return ResponseReply(op_id, 200, input_items=found.items, item_ids=found.ids,
                         has_more=found.has_more)
