"""The response store shared by replicas (each backend): any replica reads, continues and deletes
any response, cancels reach the owner, a dead owner's responses are ended; and what a row keeps."""

import msgspec
from openai.types.responses import Response

from daemon.responses.store import ResponseStore
from daemon.responses.watcher import OWNER_LOST_MESSAGE
from ipc.reasons import Reason
from ipc.records import Message, Usage
from ipc.response_records import (
    ItemsPage,
    ResponseCancel,
    ResponseDelete,
    ResponseInputItems,
    ResponseOp,
)
from proxy.responses.input_items import input_item_objects
from tests.daemon.responses.test_store import (
    Clock,
    Open,
    clock,
    get,
    op,
    open_store,
    store,
    submit,
    target,
)
from tests.support.wait import wait_for

__all__ = ["clock", "open_store", "store", "target"]  # the fixtures, shared with test_store


def test_any_replica_reads_continues_and_deletes_any_response(open_store: Open) -> None:
    a, b = open_store("a"), open_store("b")
    a.watcher().renew()
    a.begin(submit("resp_1", "one"))
    assert b.handle_op(op(ResponseDelete("resp_1")), running=False).reason is Reason.INVALID
    a.complete("resp_1", "ONE", Usage(1, 1))
    assert Response.model_validate(get(b, "resp_1")[1]).output_text == "ONE"
    second = submit("resp_2", "two", previous="resp_1")
    assert b.conversation(second) is not None
    b.begin(second)
    b.complete("resp_2", "TWO", Usage(1, 1))
    items = a.handle_op(op(ResponseInputItems("resp_2")), running=False)
    assert items.reason is None and items.input_items is not None
    assert len(input_item_objects(items.input_items, items.item_ids)) == 1
    assert a.handle_op(op(ResponseDelete("resp_2")), running=False).reason is None
    assert get(b, "resp_2")[0] is Reason.NOT_FOUND


def test_cancel_through_another_replica_reaches_the_owner(open_store: Open) -> None:
    owner, other = open_store("owner"), open_store("other")
    owner.watcher().renew()
    owner.begin(submit("resp_bg", background=True))
    reply = other.handle_op(op(ResponseCancel("resp_bg")), running=False)
    assert reply.reason is None and reply.response is not None
    assert reply.response.status == "cancelled"
    assert get(owner, "resp_bg")[1]["status"] == "cancelled"  # type: ignore[index]
    assert owner.take_cancels() == []  # nothing until the owner's watcher looks
    assert other.watcher().poll_cancels() == 0  # a request names its owner only
    assert owner.watcher().poll_cancels() == 1
    assert owner.take_cancels() == ["resp_bg"]
    assert owner.watcher().poll_cancels() == 0  # taken once
    # Cancelling again, anywhere, answers the same and asks nothing more of the owner.
    assert other.handle_op(op(ResponseCancel("resp_bg")), running=False).reason is None
    assert owner.watcher().poll_cancels() == 0


def test_the_watcher_thread_hands_over_a_cancel(open_store: Open) -> None:
    owner, other = open_store("owner", lease_s=3.0), open_store("other")
    owner.start_watching()
    owner.begin(submit("resp_bg", background=True))
    assert other.handle_op(op(ResponseCancel("resp_bg")), running=False).reason is None
    taken: list[str] = []
    wait_for(lambda: taken.extend(owner.take_cancels()) or taken, 10, "the cancel at the owner")
    assert taken == ["resp_bg"]


def test_a_dead_owners_responses_are_ended_by_the_next_replica(open_store: Open,
                                                               clock: Clock) -> None:
    dead, alive = open_store("dead", lease_s=5.0), open_store("alive", lease_s=5.0)
    dead.watcher().renew()
    alive.watcher().renew()
    dead.begin(submit("resp_bg", background=True))
    dead.begin(submit("resp_fg"))
    alive.begin(submit("resp_mine", background=True))
    assert alive.watcher().sweep() == 0  # a lease still running: nothing to do
    assert alive.handle_op(op(ResponseDelete("resp_fg")), running=False).reason is Reason.INVALID

    clock.now += 6.0  # `dead` renews no more; `alive` does
    alive.watcher().renew()
    assert alive.watcher().sweep() == 2
    parsed = Response.model_validate(get(alive, "resp_bg")[1])
    assert parsed.status == "failed"
    assert parsed.error is not None and parsed.error.message == OWNER_LOST_MESSAGE
    assert get(alive, "resp_fg")[0] is Reason.NOT_FOUND
    assert get(alive, "resp_mine")[1]["status"] == "queued"  # type: ignore[index]
    assert alive.watcher().sweep() == 0


def test_any_text_is_stored_nul_included(store: ResponseStore) -> None:
    text = "a\x00b \"quoted\" ünï \\ end"
    store.begin(submit("resp_1", text, instructions=text))
    store.complete("resp_1", text, Usage(1, 1))
    parsed = Response.model_validate(get(store, "resp_1")[1])
    assert parsed.output_text == text and parsed.instructions == text
    assert store.history("resp_1") == [Message("user", text), Message("assistant", text)]
    store.begin(submit("resp_2"))
    store.fail("resp_2", text)
    assert get(store, "resp_2")[1]["error"]["message"] == text  # type: ignore[index]


def test_input_items_are_answered_a_page_at_a_time(open_store: Open) -> None:
    store = open_store("local")
    record = submit("resp_abc")
    assert record.response is not None
    items = [{"type": "message", "role": "user", "content": f"m{i}"} for i in range(30)]
    record.response = msgspec.structs.replace(
        record.response, input_items=msgspec.json.encode(items).decode())
    store.begin(record)
    first = store.handle_op(ResponseOp("op", ResponseInputItems("resp_abc", ItemsPage(limit=5)),
                                       1), running=False)
    assert first.reason is None and first.has_more and first.input_items is not None
    assert first.item_ids == [f"msg_abc_{i}" for i in range(29, 24, -1)]
    assert len(msgspec.json.decode(first.input_items)) == 5
    unknown = store.handle_op(ResponseOp(
        "op", ResponseInputItems("resp_abc", ItemsPage(after="msg_nope")), 1), running=False)
    assert unknown.reason is Reason.INVALID and unknown.param == "after" and unknown.input_items is None
