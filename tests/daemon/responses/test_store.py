"""The response store, run against each backend: SQLite and PostgreSQL (a throwaway server)."""

import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from openai.types.responses import Response

from daemon.rejected import ContextBytes, Rejected
from daemon.responses.store import CRASHED_MESSAGE, SCHEMA_VERSION, ResponseStore, StoreError
from ipc.reasons import Reason
from ipc.records import Message, RequestKind, ResponseFields, SamplingParams, Submit, Usage
from ipc.response_records import (
    ResponseCancel,
    ResponseDelete,
    ResponseGet,
    ResponseOp,
    ResponseReply,
    StoreRequest,
)
from proxy.responses.response_object import stored_response_object


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def submit(
    rid: str,
    text: str = "hi",
    *,
    previous: str | None = None,
    background: bool = False,
    store: bool = True,
    instructions: str | None = None,
    tenant: str = "",
) -> Submit:
    fields = ResponseFields(
        store=store,
        background=background,
        previous_response_id=previous,
        instructions=instructions,
        input=[Message("user", text)],
        input_items=msgspec.json.encode([{"role": "user", "content": text}]).decode(),
        created_at=1_700_000_000,
        model="tiny",
        tenant=tenant,
    )
    return Submit(rid, RequestKind.RESPONSE, SamplingParams(max_tokens=8), response=fields, epoch=1)


def op(request: StoreRequest) -> ResponseOp:
    return ResponseOp("op", request, 1)


def response_object(reply: ResponseReply) -> dict[str, Any] | None:
    """The Response object the proxy answers with."""
    return None if reply.response is None else stored_response_object(reply.response)


def get(store: ResponseStore, rid: str) -> tuple[int, dict[str, Any] | None]:
    reply = store.handle_op(op(ResponseGet(rid)), running=False)
    return reply.reason, response_object(reply)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a store lives: a SQLite file, or a fresh schema in the test PostgreSQL."""
    if request.param == "sqlite":
        return tmp_path / "state" / "responses.db"
    return str(request.getfixturevalue("postgres").new_schema())


Open = Callable[..., ResponseStore]


@pytest.fixture
def open_store(target: Path | str, clock: Clock) -> Iterator[Open]:
    opened: list[ResponseStore] = []

    def open_(replica_id: str = "r1", max_count: int = 100, **kw: Any) -> ResponseStore:
        s = ResponseStore(target, max_count=max_count, max_age_s=3600.0, clock=clock,
                          replica_id=replica_id, **kw)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store: Open) -> ResponseStore:
    return open_store()


def test_placeholder_lifecycle(store: ResponseStore) -> None:
    store.begin(submit("resp_1", instructions="be brief"))
    assert store.num_placeholders() == 1
    reason, body = get(store, "resp_1")
    assert reason is None and body is not None
    assert body["status"] == "in_progress" and body["output"] == []

    store.complete("resp_1", "hello", Usage(4, 2))
    assert store.num_placeholders() == 0
    reason, body = get(store, "resp_1")
    assert reason is None
    parsed = Response.model_validate(body)
    assert parsed.status == "completed"
    assert parsed.output_text == "hello"
    assert parsed.instructions == "be brief"
    assert parsed.usage is not None and parsed.usage.total_tokens == 6
    assert parsed.max_output_tokens == 8


def test_length_limited_completion_is_incomplete(store: ResponseStore) -> None:
    store.begin(submit("resp_1"))
    store.complete("resp_1", "cut", Usage(1, 8), incomplete_reason="max_output_tokens")
    parsed = Response.model_validate(get(store, "resp_1")[1])
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None


def test_store_false_leaves_no_row(store: ResponseStore) -> None:
    store.begin(submit("resp_1", store=False))
    assert store.num_placeholders() == 0
    store.complete("resp_1", "x", Usage(1, 1))
    assert get(store, "resp_1")[0] is Reason.NOT_FOUND
    assert store.num_stored() == 0


def test_remove_on_abort_deletes_the_placeholder(store: ResponseStore) -> None:
    store.begin(submit("resp_1"))
    store.remove("resp_1")
    assert store.num_placeholders() == 0
    gone = store.handle_op(op(ResponseGet("resp_1")), running=False)
    assert gone.reason is Reason.NOT_FOUND
    assert gone.message == "No response found with id 'resp_1'."


def test_failed_response_keeps_its_error(store: ResponseStore) -> None:
    store.begin(submit("resp_1"))
    store.fail("resp_1", "out of memory")
    parsed = Response.model_validate(get(store, "resp_1")[1])
    assert parsed.status == "failed"
    assert parsed.error is not None and parsed.error.message == "out of memory"


def test_background_cancel_stays_cancelled_after_a_late_finish(store: ResponseStore) -> None:
    store.begin(submit("resp_bg", background=True))
    assert get(store, "resp_bg")[1]["status"] == "queued"  # type: ignore[index]
    reply = store.handle_op(op(ResponseCancel("resp_bg")), running=True)
    assert reply.reason is None
    assert Response.model_validate(response_object(reply)).status == "cancelled"
    assert store.num_placeholders() == 0

    # The engine's last tick races the cancel; and its abort path must not delete the row.
    store.complete("resp_bg", "late", Usage(1, 1))
    store.fail("resp_bg", "late")
    store.remove("resp_bg")
    reason, body = get(store, "resp_bg")
    assert reason is None and body is not None
    assert body["status"] == "cancelled" and body["output"] == [] and body["error"] is None

    again = store.handle_op(op(ResponseCancel("resp_bg")), running=False)
    assert again.reason is None


def test_cancel_refusals(store: ResponseStore) -> None:
    store.begin(submit("resp_done", background=True))
    store.complete("resp_done", "x", Usage(1, 1))
    reply = store.handle_op(op(ResponseCancel("resp_done")), running=False)
    assert reply.reason is Reason.INVALID
    assert reply.message == "Cannot cancel a response that is completed."

    store.begin(submit("resp_fg"))
    reply = store.handle_op(op(ResponseCancel("resp_fg")), running=True)
    assert reply.reason is Reason.INVALID and "only background" in (reply.message or "")
    assert get(store, "resp_fg")[1]["status"] == "in_progress"  # type: ignore[index]

    assert store.handle_op(op(ResponseCancel("resp_nope")), running=False).reason is Reason.NOT_FOUND


def test_delete(store: ResponseStore) -> None:
    store.begin(submit("resp_1"))
    busy = store.handle_op(op(ResponseDelete("resp_1")), running=True)
    assert busy.reason is Reason.INVALID and "in_progress" in (busy.message or "")

    store.complete("resp_1", "x", Usage(1, 1))
    reply = store.handle_op(op(ResponseDelete("resp_1")), running=False)
    assert reply.reason is None
    assert reply.deleted and reply.response is None
    assert get(store, "resp_1")[0] is Reason.NOT_FOUND
    assert store.handle_op(op(ResponseDelete("resp_1")), running=False).reason is Reason.NOT_FOUND


def test_delete_cancels_a_live_background_response_first(open_store: Open) -> None:
    owner, other = open_store("owner"), open_store("other")
    owner.watcher().renew()
    owner.begin(submit("resp_mine", background=True))
    reply = owner.handle_op(op(ResponseDelete("resp_mine")), running=True)
    assert reply.reason is None and reply.deleted
    assert get(owner, "resp_mine")[0] is Reason.NOT_FOUND and owner.num_placeholders() == 0
    # Deleted through another replica: its owner is asked to stop it, as for a cancel.
    owner.begin(submit("resp_there", background=True))
    assert other.handle_op(op(ResponseDelete("resp_there")), running=False).reason is None
    assert get(owner, "resp_there")[0] is Reason.NOT_FOUND
    assert owner.watcher().poll_cancels() == 1 and owner.take_cancels() == ["resp_there"]


def test_chained_history_of_three_turns(store: ResponseStore) -> None:
    store.begin(submit("resp_1", "one", instructions="first rules"))
    store.complete("resp_1", "ONE", Usage(1, 1))
    store.begin(submit("resp_2", "two", previous="resp_1"))
    store.complete("resp_2", "TWO", Usage(1, 1))

    third = submit("resp_3", "three", previous="resp_2", instructions="new rules")
    # Instructions are not carried over previous_response_id; this turn's come first.
    assert store.conversation(third) == [
        Message("system", "new rules"),
        Message("user", "one"),
        Message("assistant", "ONE"),
        Message("user", "two"),
        Message("assistant", "TWO"),
        Message("user", "three"),
    ]
    store.begin(third)
    store.complete("resp_3", "THREE", Usage(1, 1))
    # Each row holds the whole conversation: dropping a link does not break the chain.
    store.handle_op(op(ResponseDelete("resp_1")), running=False)
    history = store.history("resp_3")
    assert history is not None
    assert [m.content for m in history] == ["one", "ONE", "two", "TWO", "three", "THREE"]
    assert get(store, "resp_3")[1]["previous_response_id"] == "resp_2"  # type: ignore[index]


def test_admission_then_begin_reads_the_history_once(store: ResponseStore) -> None:
    store.begin(submit("resp_1", "one"))
    store.complete("resp_1", "ONE", Usage(1, 1))
    reads: list[str] = []
    store.db.trace = lambda sql: reads.append(sql) if sql.startswith("SELECT") else None
    second = submit("resp_2", "two", previous="resp_1")
    store.conversation(second)
    store.begin(second)
    assert len([sql for sql in reads if "messages" in sql]) == 1
    store.complete("resp_2", "TWO", Usage(1, 1))
    history = store.history("resp_2")
    assert history is not None and [m.content for m in history] == ["one", "ONE", "two", "TWO"]


def test_a_continuation_whose_history_cannot_fit_is_refused_before_it_is_read(
        store: ResponseStore) -> None:
    """The previous response's conversation and output, with the new input, hold more text than
    the context's tokens can spell: its row's conversation is never read."""
    store.begin(submit("resp_1", "x" * 600))
    store.complete("resp_1", "y" * 600, Usage(1, 1))
    reads: list[str] = []
    store.db.trace = reads.append
    with pytest.raises(Rejected) as exc:
        store.conversation(submit("resp_2", "hi", previous="resp_1"), ContextBytes(100, 12))
    assert (exc.value.param, exc.value.reason) == ("previous_response_id",
                                                  Reason.CONTEXT_LENGTH_EXCEEDED)
    assert "1202" in exc.value.message and "1200" in exc.value.message
    assert not [sql for sql in reads if "messages" in sql]
    fits = store.conversation(submit("resp_2", "hi", previous="resp_1"), ContextBytes(101, 12))
    assert fits is not None and [m.content for m in fits] == ["x" * 600, "y" * 600, "hi"]


def test_unknown_or_running_previous_gives_none(store: ResponseStore) -> None:
    assert store.conversation(submit("resp_2", previous="resp_missing")) is None
    store.begin(submit("resp_1"))
    assert store.history("resp_1") is None
    with pytest.raises(ValueError, match="resp_1"):
        store.begin(submit("resp_2", previous="resp_1"))
    assert store.num_placeholders() == 1


def test_store_false_turn_can_continue_a_stored_chain(store: ResponseStore) -> None:
    store.begin(submit("resp_1", "one"))
    store.complete("resp_1", "ONE", Usage(1, 1))
    conversation = store.conversation(submit("resp_2", "two", previous="resp_1", store=False))
    assert conversation == [Message("user", "one"), Message("assistant", "ONE"),
                            Message("user", "two")]


def test_survives_reopen(open_store: Open, target: Path | str) -> None:
    first = open_store()
    first.begin(submit("resp_1", "one"))
    first.complete("resp_1", "ONE", Usage(1, 1))
    first.close()
    if isinstance(target, Path):
        assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(target.stat().st_mode) == 0o600

    second = open_store()
    assert second.cleanup_crashed() == 0
    assert Response.model_validate(get(second, "resp_1")[1]).output_text == "ONE"
    assert second.history("resp_1") == [Message("user", "one"), Message("assistant", "ONE")]


def test_cleanup_crashed_ends_placeholders_of_a_crashed_run(open_store: Open) -> None:
    crashed = open_store()
    crashed.begin(submit("resp_fg"))
    crashed.begin(submit("resp_bg", background=True))
    crashed.begin(submit("resp_done"))
    crashed.complete("resp_done", "x", Usage(1, 1))
    other = open_store("r2")
    other.begin(submit("resp_other"))
    crashed.close()  # no complete/remove: the process died here

    restarted = open_store()
    assert restarted.num_placeholders() == 0
    assert restarted.cleanup_crashed() == 2
    assert get(restarted, "resp_fg")[0] is Reason.NOT_FOUND
    parsed = Response.model_validate(get(restarted, "resp_bg")[1])
    assert parsed.status == "failed"
    assert parsed.error is not None and parsed.error.message == CRASHED_MESSAGE
    assert get(restarted, "resp_done")[0] is None
    # Another replica's placeholder is not this replica's to end.
    assert get(restarted, "resp_other")[1]["status"] == "in_progress"  # type: ignore[index]
    assert restarted.cleanup_crashed() == 0


def _sizes(store: ResponseStore) -> dict[str, int]:
    return {r["id"]: r["size"] for r in store.db.execute("SELECT id, size FROM responses").rows}


def test_duplicate_response_id_is_refused(store: ResponseStore) -> None:
    store.begin(submit("resp_1"))
    with pytest.raises(ValueError, match="already stored"):
        store.begin(submit("resp_1"))
    assert store.num_placeholders() == 1


# --- schema versions -----------------------------------------------------------------------------


def test_upgrades_a_version_1_file(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE responses (id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at INTEGER "
        "NOT NULL, stored_at REAL NOT NULL, completed_at REAL, model TEXT NOT NULL, instructions "
        "TEXT, previous_response_id TEXT, background INTEGER NOT NULL, input_items TEXT NOT NULL,"
        " messages TEXT NOT NULL, output_text TEXT, usage TEXT, error TEXT, incomplete_reason "
        "TEXT, temperature REAL, top_p REAL, max_output_tokens INTEGER);"
        "INSERT INTO responses VALUES ('resp_old', 'completed', 1, 1.0, 2.0, 'tiny', NULL, NULL,"
        " 0, '[]', '[{\"role\":\"user\",\"content\":\"hi\"}]', 'HI', NULL, NULL, NULL, NULL, "
        "NULL, 8);"
        "INSERT INTO responses VALUES ('resp_bg', 'in_progress', 1, 1.0, NULL, 'tiny', NULL, "
        "NULL, 1, '[]', '[]', NULL, NULL, NULL, NULL, NULL, NULL, 8);"
        "PRAGMA user_version=1;")
    old.close()
    store = ResponseStore(path, 100, 3600.0, replica_id="host:8000")
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.history("resp_old") == [Message("user", "hi"), Message("assistant", "HI")]
    # Rows from before sizes are measured on the way (free text quoted by version 2).
    assert _sizes(store)["resp_old"] == len('[]' '[{"role":"user","content":"hi"}]' '"HI"')
    assert store.cleanup_crashed() == 1  # a row from before owners belongs to whoever opens it
    assert get(store, "resp_bg")[1]["status"] == "failed"  # type: ignore[index]
    store.close()


def test_refuses_a_store_newer_than_this_code(open_store: Open, target: Path | str) -> None:
    store = open_store()
    if isinstance(target, Path):
        store.db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    else:
        store.db.execute("INSERT INTO tether_schema (version) VALUES (?)", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1} is newer"):
        ResponseStore(target, 100, 3600.0)


def test_bad_state_url_is_named() -> None:
    with pytest.raises(StoreError, match="expected postgresql://"):
        ResponseStore("mysql://u:secret@h/db", 100, 3600.0)


def test_unreachable_postgresql_is_named_without_its_password(tmp_path: Path) -> None:
    url = f"postgresql://u:hunter2@/db?host={tmp_path}&port=1"
    with pytest.raises(StoreError, match="cannot connect") as e:
        ResponseStore(url, 100, 3600.0)
    assert "hunter2" not in str(e.value) and "u:***@" in str(e.value)
