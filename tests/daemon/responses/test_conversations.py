"""Conversations in the response store, on each backend (SQLite and PostgreSQL): the CRUD ops, and
turns that append atomically on completion and append nothing otherwise."""

import msgspec
import pytest

from daemon.rejected import ContextBytes, Rejected
from daemon.responses.conversations import ConversationLimits
from daemon.responses.items import PAGE_BYTES
from daemon.responses.store import ResponseStore
from ipc.reasons import Reason
from ipc.records import Message, RequestKind, ResponseFields, SamplingParams, Submit, Usage
from ipc.response_records import (
    ConversationCreate,
    ConversationDelete,
    ConversationGet,
    ConversationItemDelete,
    ConversationItemGet,
    ConversationItems,
    ConversationItemsAdd,
    ConversationItemsList,
    ConversationUpdate,
    ItemsPage,
    ResponseGet,
    ResponseOp,
    ResponseReply,
    StoreRequest,
)
from proxy.responses.input_items import input_item_objects
from tests.daemon.responses.test_store import Clock, Open, clock, open_store, target

__all__ = ["clock", "open_store", "target"]  # the fixtures, shared with test_store



def user_items(*texts: str) -> ConversationItems:
    items = [{"type": "message", "role": "user", "content": t} for t in texts]
    return ConversationItems(msgspec.json.encode(items).decode(),
                             [[Message("user", t)] for t in texts])


def op(store: ResponseStore, request: StoreRequest, tenant: str = "") -> ResponseReply:
    return store.handle_op(ResponseOp("op", request, 1, tenant=tenant), running=False)


def texts(reply: ResponseReply) -> list[str]:
    assert reply.reason is None and reply.input_items is not None, reply
    objects = input_item_objects(reply.input_items, reply.item_ids)
    return [o["content"][0]["text"] for o in objects]


def turn(rid: str, text: str, cid: str = "conv_1", background: bool = False) -> Submit:
    items = msgspec.json.encode([{"type": "message", "role": "user", "content": text}]).decode()
    fields = ResponseFields(background=background, input=[Message("user", text)],
                            input_items=items, created_at=1, model="tiny", conversation=cid,
                            input_spans=[1])
    return Submit(rid, RequestKind.RESPONSE, SamplingParams(max_tokens=8), response=fields, epoch=1)


def start(store: ResponseStore, sub: Submit) -> list[Message]:
    """What admission does: the history, then the placeholder (and the claim)."""
    messages = store.conversation(sub)
    assert messages is not None
    store.begin(sub)
    return messages


@pytest.fixture
def store(open_store: Open) -> ResponseStore:
    return open_store()


def test_create_get_update_delete(store: ResponseStore) -> None:
    reply = op(store, ConversationCreate("conv_1", items=user_items("a", "b"), metadata={"k": "v"}))
    assert reply.reason is None and reply.conversation is not None
    assert reply.conversation.metadata == {"k": "v"}
    got = op(store, ConversationGet("conv_1"))
    assert got.conversation is not None and got.conversation.metadata == {"k": "v"}
    assert op(store, ConversationUpdate("conv_1", {"x": "y"})).conversation.metadata == {"x": "y"}
    assert store.conversation_counts() == (1, 2)
    assert op(store, ConversationDelete("conv_1")).deleted
    assert op(store, ConversationGet("conv_1")).reason is Reason.NOT_FOUND
    assert op(store, ConversationItemsList("conv_1")).reason is Reason.NOT_FOUND
    assert store.conversation_counts() == (0, 0)


def test_items_page_append_get_delete(store: ResponseStore) -> None:
    op(store, ConversationCreate("conv_1", items=user_items("a", "b")))
    added = op(store, ConversationItemsAdd("conv_1", user_items("c", "d", "e")))
    assert added.input_items is None and len(added.item_ids) == 3  # the ids: the proxy lists
    assert all(i.startswith("msg_") for i in added.item_ids)
    page = op(store, ConversationItemsList("conv_1", ItemsPage(limit=2, order="asc")))
    assert texts(page) == ["a", "b"] and page.has_more
    after = op(store, ConversationItemsList("conv_1", ItemsPage(limit=10, order="asc",
                                                           after=page.item_ids[-1])))
    assert texts(after) == ["c", "d", "e"] and not after.has_more
    desc = op(store, ConversationItemsList("conv_1", ItemsPage(limit=10)))
    assert texts(desc) == ["e", "d", "c", "b", "a"]
    c_id = added.item_ids[0]
    assert texts(op(store, ConversationItemGet("conv_1", c_id))) == ["c"]
    assert op(store, ConversationItemDelete("conv_1", c_id)).conversation is not None
    assert op(store, ConversationItemGet("conv_1", c_id)).reason is Reason.NOT_FOUND
    assert op(store, ConversationItemDelete("conv_1", c_id)).reason is Reason.NOT_FOUND
    assert op(store, ConversationItemsList("conv_1", ItemsPage(after="nope"))).reason is Reason.INVALID
    assert store.conversation_counts() == (1, 4)


def test_a_turn_appends_its_input_and_output_when_it_completes(store: ResponseStore) -> None:
    op(store, ConversationCreate("conv_1", items=user_items("first")))
    assert start(store, turn("resp_1", "second")) == [Message("user", "first"),
                                                     Message("user", "second")]
    assert texts(op(store, ConversationItemsList("conv_1", ItemsPage(order="asc")))) == ["first"]
    store.complete("resp_1", "answer", Usage(3, 1))
    listed = op(store, ConversationItemsList("conv_1", ItemsPage(order="asc")))
    assert texts(listed) == ["first", "second", "answer"]
    assert listed.item_ids[1:] == ["msg_1_0", "msg_1"]  # as the response lists them
    assert start(store, turn("resp_2", "third"))[-2:] == [Message("assistant", "answer"),
                                                         Message("user", "third")]
    get = store.handle_op(ResponseOp("g", ResponseGet("resp_1"), 1), running=False)
    assert get.response is not None and get.response.conversation == "conv_1"


@pytest.mark.parametrize("ending", ["remove", "fail", "cancel"])
def test_a_turn_that_does_not_complete_appends_nothing(store: ResponseStore, ending: str) -> None:
    op(store, ConversationCreate("conv_1", items=user_items("first")))
    start(store, turn("resp_1", "second", background=ending == "cancel"))
    if ending == "fail":
        store.fail("resp_1", "boom")
    else:
        getattr(store, ending)("resp_1")
    store.complete("resp_1", "late", Usage(1, 1))  # a late completion moves nothing
    assert texts(op(store, ConversationItemsList("conv_1", ItemsPage(order="asc")))) == ["first"]
    assert store.num_placeholders() == 0
    start(store, turn("resp_2", "again"))  # the claim was let go


def test_a_second_turn_while_one_runs_is_409_naming_it(open_store: Open) -> None:
    one, two = open_store("r1"), open_store("r2")  # two replicas of one store
    op(one, ConversationCreate("conv_1"))
    start(one, turn("resp_1", "a"))
    with pytest.raises(Rejected, match="resp_1") as exc:
        start(two, turn("resp_2", "b"))
    assert exc.value.reason is Reason.CONVERSATION_LOCKED
    assert two.handle_op(ResponseOp("g", ResponseGet("resp_2"), 1), running=False).reason is Reason.NOT_FOUND
    one.complete("resp_1", "done", Usage(1, 1))
    start(two, turn("resp_2", "b"))
    two.complete("resp_2", "done too", Usage(1, 1))
    assert texts(op(one, ConversationItemsList("conv_1", ItemsPage(order="asc")))) == [
        "a", "done", "b", "done too"]


def test_a_stale_claim_is_taken_over(store: ResponseStore) -> None:
    op(store, ConversationCreate("conv_1"))
    start(store, turn("resp_1", "a"))
    store.db.execute("DELETE FROM responses WHERE id = ?", ("resp_1",))  # a crash leftover
    start(store, turn("resp_2", "b"))


def test_unknown_and_full_conversations_are_refused(open_store: Open) -> None:
    store = open_store(conversations=ConversationLimits(max_items=3))
    assert store.conversation(turn("resp_1", "a", cid="conv_none")) is None
    op(store, ConversationCreate("conv_1", items=user_items("a", "b")))
    with pytest.raises(Rejected) as exc:
        start(store, turn("resp_1", "c"))  # its input and its output: 4 > 3
    assert exc.value.reason is Reason.CONVERSATION_FULL
    full = op(store, ConversationItemsAdd("conv_1", user_items("c", "d")))
    assert full.reason is Reason.CONVERSATION_FULL
    assert op(store, ConversationItemsAdd("conv_1", user_items("c"))).reason is None


def test_prune_by_count_age_and_bytes(open_store: Open, clock: Clock) -> None:
    store = open_store(conversations=ConversationLimits(max_count=2, max_age_s=100.0,
                                                        max_bytes=10_000))
    for i in range(3):
        clock.now += 1
        op(store, ConversationCreate(f"conv_{i}", items=user_items(str(i))))
    assert store.conversations.prune() == 1
    assert op(store, ConversationGet("conv_0")).reason is Reason.NOT_FOUND
    assert store.conversation_counts() == (2, 2)
    op(store, ConversationItemsAdd("conv_2", user_items("x" * 20_000)))
    op(store, ConversationGet("conv_1"))  # a read is no change: conv_1 stays the oldest
    assert store.conversations.prune() == 2  # conv_2 is past the bytes, and conv_1 is older
    assert store.conversation_counts() == (0, 0)
    op(store, ConversationCreate("conv_3", items=user_items("3")))
    clock.now += 200
    assert store.conversations.prune() == 1  # by age
    rows = store.db.execute("SELECT count(*) AS n FROM conversation_items").one()
    assert rows["n"] == 0


def test_a_turn_whose_conversation_cannot_fit_is_refused_before_its_items_are_read(
        store: ResponseStore) -> None:
    """Its items' text and the turn's own is more than the context's tokens can spell: the
    items are never read (one could hold gigabytes)."""
    op(store, ConversationCreate("conv_1", items=user_items("x" * 600, "y" * 600)))
    reads: list[str] = []
    store.db.trace = reads.append
    with pytest.raises(Rejected) as exc:
        store.conversation(turn("resp_1", "hi"), ContextBytes(100, 12))  # 1,202 > 1,200 bytes
    assert (exc.value.param, exc.value.reason) == ("conversation", Reason.CONTEXT_LENGTH_EXCEEDED)
    assert "1202" in exc.value.message and "1200" in exc.value.message
    assert not [sql for sql in reads if "conversation_items" in sql]
    assert store.conversation(turn("resp_1", "hi"), ContextBytes(101, 12)) is not None
    listed = op(store, ConversationItemsList("conv_1", ItemsPage(order="asc")))
    op(store, ConversationItemDelete("conv_1", listed.item_ids[0]))  # its text goes with it
    assert store.conversation(turn("resp_1", "hi"), ContextBytes(51, 12)) is not None


def test_a_page_of_items_stops_short_of_its_bytes_bound(store: ResponseStore) -> None:
    """Items each near half the page's bytes: a page holds as many as fit (never none), says
    there are more, and the next page goes on from it."""
    big = [c * (PAGE_BYTES // 3) for c in "abc"]
    op(store, ConversationCreate("conv_1", items=user_items(*big)))
    seen: list[str] = []
    after = None
    for _ in range(4):
        page = op(store, ConversationItemsList("conv_1", ItemsPage(limit=20, order="asc",
                                                              after=after)))
        assert 1 <= len(page.item_ids) < 3 and len(page.input_items or "") <= PAGE_BYTES
        seen += texts(page)
        after = page.item_ids[-1]
        if not page.has_more:
            break
    assert seen == big


def test_retention_is_fair_between_tenants(open_store: Open, clock: Clock) -> None:
    """One tenant's flood of conversations costs another tenant, holding less than its share,
    nothing: the flood's own oldest go."""
    store = open_store(conversations=ConversationLimits(max_count=4, max_bytes=1 << 30))
    op(store, ConversationCreate("conv_mine"), tenant="a")
    for i in range(6):
        clock.now += 1
        op(store, ConversationCreate(f"conv_{i}"), tenant="b")
    assert store.conversations.prune() == 3
    kept = [cid for cid in ["conv_mine", *[f"conv_{i}" for i in range(6)]]
            if op(store, ConversationGet(cid)).reason is None]
    assert kept == ["conv_mine", "conv_3", "conv_4", "conv_5"]
