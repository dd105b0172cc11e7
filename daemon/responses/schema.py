"""The response store's schema as numbered migrations, one statement list per SQL dialect.

A store records the highest version applied (SQLite: ``PRAGMA user_version``; PostgreSQL: the
``tether_schema`` table) and applies the missing ones at start, in one transaction. A store newer
than this code is refused rather than guessed at. Add a migration; never edit a published one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    what: str
    sqlite: tuple[str, ...]
    postgresql: tuple[str, ...]

    def statements(self, dialect: str) -> tuple[str, ...]:
        return self.sqlite if dialect == "sqlite" else self.postgresql


def _responses_table(real: str, big: str) -> str:
    return f"""CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    created_at {big} NOT NULL,
    stored_at {real} NOT NULL,
    completed_at {real},
    model TEXT NOT NULL,
    instructions TEXT,
    previous_response_id TEXT,
    background INTEGER NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    output_text TEXT,
    usage TEXT,
    error TEXT,
    incomplete_reason TEXT,
    temperature {real},
    top_p {real},
    max_output_tokens INTEGER
)"""


_STORED_AT_INDEX = "CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at)"

# Version 2: many replicas share one store. A row names the replica that runs it (`owner`); each
# replica holds a lease it renews; a cancel for a response that another replica runs is left in
# `cancel_requests` for that owner (and, on PostgreSQL, announced with NOTIFY). Free text
# (instructions, output, error) is held as a JSON string, since PostgreSQL's text refuses NUL.
_SHARED = (
    "ALTER TABLE responses ADD COLUMN owner TEXT",
    "CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, status)",
)
_QUOTE_TEXT = tuple(f"UPDATE responses SET {c} = json_quote({c}) WHERE {c} IS NOT NULL"
                    for c in ("output_text", "instructions", "error"))


def _replica_tables(real: str) -> tuple[str, ...]:
    return (
        f"CREATE TABLE IF NOT EXISTS replicas (replica_id TEXT PRIMARY KEY, "
        f"lease_until {real} NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS cancel_requests (response_id TEXT PRIMARY KEY, "
        f"owner TEXT NOT NULL, requested_at {real} NOT NULL)",
        "CREATE INDEX IF NOT EXISTS cancel_requests_owner ON cancel_requests (owner)",
    )


# Version 3: each row's `size`, the bytes of the text it stores (input items, conversation,
# instructions, output, error, usage...), so that retention can bound the store by bytes.
# Existing rows are measured once here; the store keeps the column up to date from then on.
_TEXT_COLUMNS = ("input_items", "messages", "instructions", "output_text", "error", "usage",
                 "incomplete_reason")


def _sized(octets: str) -> tuple[str, ...]:
    total = " + ".join(f"coalesce({octets.format(c)}, 0)" for c in _TEXT_COLUMNS)
    return ("ALTER TABLE responses ADD COLUMN size BIGINT NOT NULL DEFAULT 0",
            f"UPDATE responses SET size = {total}")


# Version 4: conversations (daemon/responses/conversations.py). A conversation counts its items
# and their bytes, and names the turn that runs on it (`running_response_id`, set at admission and
# cleared when the turn ends); an item is stored as validated (`item`) with the messages it
# renders as (`messages`), at its position `seq`. A response names the conversation it is a turn of.
def _conversation_tables(real: str) -> tuple[str, ...]:
    return (
        f"""CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at BIGINT NOT NULL,
    updated_at {real} NOT NULL,
    metadata TEXT NOT NULL,
    num_items BIGINT NOT NULL DEFAULT 0,
    size BIGINT NOT NULL DEFAULT 0,
    next_seq BIGINT NOT NULL DEFAULT 0,
    running_response_id TEXT
)""",
        "CREATE INDEX IF NOT EXISTS conversations_updated_at ON conversations (updated_at)",
        """CREATE TABLE IF NOT EXISTS conversation_items (
    conversation_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,
    messages TEXT NOT NULL,
    size BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, seq)
)""",
        "CREATE INDEX IF NOT EXISTS conversation_items_id ON conversation_items "
        "(conversation_id, item_id)",
        "ALTER TABLE responses ADD COLUMN conversation_id TEXT",
    )


# Version 5: what the Response object echoes of its request (`echo`: text, tools, tool_choice,
# metadata, ... as JSON), and the format its output's tool calls are written in, so that a GET
# answers with the request's settings and the calls as items.
_ECHO = ("ALTER TABLE responses ADD COLUMN echo TEXT",
         "ALTER TABLE responses ADD COLUMN tool_call_format TEXT")

# Version 6: a response's input items by the id each is listed under (daemon/responses/
# item_index.py), for `item_reference` input items. Rows stored before it are not indexed.
_ITEM_INDEX = (
    """CREATE TABLE IF NOT EXISTS response_items (
    item_id TEXT NOT NULL,
    response_id TEXT NOT NULL,
    position BIGINT NOT NULL,
    PRIMARY KEY (item_id, response_id)
)""",
    "CREATE INDEX IF NOT EXISTS response_items_response ON response_items (response_id)",
)

# Version 7: tenants and the bytes of text a history holds. A response and a conversation name
# the tenant that stored them (the API key's tag, "" without keys): retention is fair between
# tenants and an item reference reaches only its own tenant's items. `text_bytes`: the bytes of
# message text a stored history renders (a response's conversation and output, a conversation's
# items), so that a turn whose history cannot fit the context is refused before it is read.
# Rows stored before it count 0, and are measured once they are read.
_TENANTS = (
    "ALTER TABLE responses ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE responses ADD COLUMN text_bytes BIGINT NOT NULL DEFAULT 0",
    "CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant, stored_at)",
    "ALTER TABLE conversations ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE conversations ADD COLUMN text_bytes BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE conversation_items ADD COLUMN text_bytes BIGINT NOT NULL DEFAULT 0",
)


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "stored responses",
              sqlite=(_responses_table("REAL", "INTEGER"), _STORED_AT_INDEX),
              postgresql=(_responses_table("DOUBLE PRECISION", "BIGINT"), _STORED_AT_INDEX)),
    Migration(2, "owners, replica leases and cancel requests",
              sqlite=(*_SHARED, *_QUOTE_TEXT, *_replica_tables("REAL")),
              postgresql=(*_SHARED, *_replica_tables("DOUBLE PRECISION"))),
    Migration(3, "the bytes each row stores",
              sqlite=_sized("length(CAST({} AS BLOB))"),
              postgresql=_sized("octet_length({})")),
    Migration(4, "conversations and their items",
              sqlite=_conversation_tables("REAL"),
              postgresql=_conversation_tables("DOUBLE PRECISION")),
    Migration(5, "the request fields a response echoes, its tool-call format",
              sqlite=_ECHO, postgresql=_ECHO),
    Migration(6, "input items by id", sqlite=_ITEM_INDEX, postgresql=_ITEM_INDEX),
    Migration(7, "tenants, and the text a history holds", sqlite=_TENANTS, postgresql=_TENANTS),
)

SCHEMA_VERSION = MIGRATIONS[-1].version
