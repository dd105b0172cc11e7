"""The databases under the response store, chosen by URL: SQLite (one pair, or pairs on one
machine) or PostgreSQL (replicas anywhere).

The store writes its SQL once, with ``?`` placeholders; each backend runs it and returns the rows
whole (the store's result sets are a row or a few ids). Nothing above this module knows which
backend it talks to, except through ``dialect`` where the SQL itself must differ.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from daemon.responses.schema import MIGRATIONS, SCHEMA_VERSION

# NOTIFY channel on which a replica learns that a response it runs was cancelled elsewhere.
CANCEL_CHANNEL = "tether_cancel"
# Serialises migrations of replicas that start at the same moment (an arbitrary constant key).
_MIGRATION_LOCK = 0x7E7E_0001


class StoreError(Exception):
    """The store cannot be used; the message names where it is and why."""


@dataclass(slots=True)
class Result:
    rows: list[Any] = field(default_factory=list)
    rowcount: int = 0

    def one(self) -> Any:
        return self.rows[0] if self.rows else None


class Executor(Protocol):
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Result: ...


class Listener(Protocol):
    """A connection subscribed to CANCEL_CHANNEL."""

    def wait(self, timeout: float) -> list[str]: ...
    def close(self) -> None: ...


class Database(Executor, Protocol):
    dialect: str
    # Where rows go for good, for messages (never a password).
    where: str
    # Called with every SQL text before it runs (tests count queries with it).
    trace: Callable[[str], None] | None

    def transaction(self) -> Any: ...
    def for_thread(self) -> Database: ...
    def notify(self, executor: Executor, payload: str) -> None: ...
    def listen(self) -> Listener | None: ...
    def close(self) -> None: ...


def redact(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)


def connect(target: Path | str | None) -> Database:
    """``None``: SQLite in memory; a Path or ``sqlite:///path``: a SQLite file;
    ``postgresql://…`` (or ``postgres://``): PostgreSQL. The schema is migrated on the way."""
    if isinstance(target, str):
        if target.startswith(("postgresql://", "postgres://")):
            db: Database = PostgresDatabase(target)
        elif target.startswith("sqlite:///"):
            db = SQLiteDatabase(Path(target.removeprefix("sqlite://")))
        else:
            raise StoreError(f"--state-url {redact(target)!r}: expected postgresql://… or "
                             "sqlite:///path")
    else:
        db = SQLiteDatabase(target)
    try:
        migrate(db)
    except StoreError:
        db.close()
        raise
    except Exception as e:
        db.close()
        raise StoreError(f"response store {db.where}: {e}") from e
    return db


# --- SQLite ------------------------------------------------------------------------------------


def _prepare_file(path: Path) -> None:
    """Creates the file owner-only from the first byte (the store holds users' conversations;
    SQLite gives the -wal and -shm files the mode of the database file). Never opens one that
    exists: closing any descriptor of a file drops every POSIX lock this process holds on it,
    SQLite's included, and another process would then take our open WAL for unused and delete
    it under us."""
    if path.exists():
        return
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))


class SQLiteDatabase:
    dialect = "sqlite"

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.where = ":memory:" if path is None else str(path)
        self.trace: Callable[[str], None] | None = None
        try:
            if path is not None:
                _prepare_file(path)
            # Autocommit: each statement is its own transaction unless wrapped in BEGIN/COMMIT.
            self._db = sqlite3.connect(self.where, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: no fsync per commit; a power cut may lose the last few responses,
            # never corrupt the file. The busy timeout lets pairs on one machine share the file.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"response store {self.where}: {e}") from e

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Result:
        if self.trace is not None:
            self.trace(sql)
        cur = self._db.execute(sql, tuple(params))
        return Result(cur.fetchall(), cur.rowcount)

    @contextmanager
    def transaction(self) -> Iterator[Executor]:
        # IMMEDIATE takes the write lock up front: two pairs migrating or pruning at once wait
        # for each other instead of failing half-way.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def for_thread(self) -> SQLiteDatabase:
        if self.path is None:
            raise StoreError("an in-memory store cannot be shared with another thread")
        other = SQLiteDatabase(self.path)
        return other

    def notify(self, executor: Executor, payload: str) -> None:
        """SQLite has no notifications: owners poll cancel_requests."""

    def listen(self) -> Listener | None:
        return None

    def version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def set_version(self, version: int) -> None:
        self._db.execute(f"PRAGMA user_version={int(version)}")

    def close(self) -> None:
        self._db.close()


# --- PostgreSQL --------------------------------------------------------------------------------


def _pg_sql(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


class _PgExecutor:
    def __init__(self, conn: Any, db: PostgresDatabase) -> None:
        self._conn = conn
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Result:
        if self._db.trace is not None:
            self._db.trace(sql)
        cur = self._conn.execute(_pg_sql(sql), tuple(params))
        rows = cur.fetchall() if cur.description is not None else []
        return Result(rows, cur.rowcount)


class _PgListener:
    def __init__(self, url: str) -> None:
        import psycopg

        self._conn = psycopg.connect(url, autocommit=True)
        self._conn.execute(f"LISTEN {CANCEL_CHANNEL}")

    def wait(self, timeout: float) -> list[str]:
        """Payloads of the notifications that arrive within ``timeout`` (returns at the first)."""
        return [n.payload for n in self._conn.notifies(timeout=timeout, stop_after=1)]

    def close(self) -> None:
        self._conn.close()


class PostgresDatabase:
    dialect = "postgresql"

    def __init__(self, url: str, pool: Any = None) -> None:
        self.url = url
        self.where = redact(url)
        self.trace: Callable[[str], None] | None = None
        self._owns_pool = pool is None
        if pool is not None:
            self._pool = pool
            return
        try:
            from psycopg.rows import dict_row
            from psycopg_pool import ConnectionPool
        except ImportError as e:
            raise StoreError(f"--state-url {self.where}: PostgreSQL needs psycopg 3 and "
                             "psycopg_pool (pip install 'tether[cluster]')") from e
        # Two connections cover the tick thread and the watcher; more only under bursts of
        # ResponseOps. Autocommit: a statement is a transaction unless `transaction()` says so.
        self._pool = ConnectionPool(url, min_size=2, max_size=4, open=False, name="tether-store",
                                    kwargs={"autocommit": True, "row_factory": dict_row})
        try:
            self._pool.open(wait=True, timeout=10.0)
        except Exception as e:
            self._pool.close()
            raise StoreError(f"response store {self.where}: cannot connect: {e}") from e

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Result:
        with self._pool.connection() as conn:
            return _PgExecutor(conn, self).execute(sql, params)

    @contextmanager
    def transaction(self) -> Iterator[Executor]:
        with self._pool.connection() as conn, conn.transaction():
            yield _PgExecutor(conn, self)

    def for_thread(self) -> PostgresDatabase:
        return PostgresDatabase(self.url, pool=self._pool)  # the pool is thread-safe

    def notify(self, executor: Executor, payload: str) -> None:
        # Inside the caller's transaction: delivered at its commit, with the request row visible.
        executor.execute("SELECT pg_notify(?, ?)", (CANCEL_CHANNEL, payload))

    def listen(self) -> Listener | None:
        return _PgListener(self.url)

    def close(self) -> None:
        if self._owns_pool:
            self._pool.close()


# --- migrations --------------------------------------------------------------------------------


def _too_new(db: Database, version: int) -> StoreError:
    return StoreError(f"response store {db.where}: schema version {version} is newer than this "
                      f"tether ({SCHEMA_VERSION}); use a newer tether or another store")


def migrate(db: Database) -> int:
    """Apply the missing migrations; returns the version the store is at."""
    if isinstance(db, SQLiteDatabase):
        return _migrate_sqlite(db)
    with db.transaction() as tx:
        tx.execute(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        tx.execute("CREATE TABLE IF NOT EXISTS tether_schema (version INTEGER NOT NULL)")
        row = tx.execute("SELECT max(version) AS version FROM tether_schema").one()
        version = row["version"] or 0
        if version > SCHEMA_VERSION:
            raise _too_new(db, version)
        for m in MIGRATIONS:
            if m.version > version:
                for statement in m.postgresql:
                    tx.execute(statement)
                tx.execute("INSERT INTO tether_schema (version) VALUES (?)", (m.version,))
    return SCHEMA_VERSION


def _migrate_sqlite(db: SQLiteDatabase) -> int:
    if db.version() > SCHEMA_VERSION:
        raise _too_new(db, db.version())
    try:
        with db.transaction() as tx:
            version = db.version()  # again, now that this connection holds the write lock
            for m in MIGRATIONS:
                if m.version > version:
                    for statement in m.sqlite:
                        tx.execute(statement)
            db.set_version(SCHEMA_VERSION)
    except sqlite3.Error as e:
        raise StoreError(f"response store {db.where}: {e}") from e
    return SCHEMA_VERSION
