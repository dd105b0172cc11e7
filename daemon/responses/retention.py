"""Retention that is fair between tenants: the store's bounds on count and bytes, applied so that
no tenant's traffic costs another tenant what it keeps within its share.

A tenant is the API key a row was stored under ("" for every client of a server without keys,
which are one tenant: an address is no identity, and one client could take many). When a table
is over a bound, rows go in the order that keeps each tenant's newest first: every tenant's
newest row is kept before any tenant's second newest, and so on (by count), or every tenant's
newest bytes before any tenant's later ones (by bytes). So a tenant holding less than its share
(the bound over the tenants that hold anything) never loses a row to another's traffic, and one
tenant alone may use the whole bound. Both queries run in the watcher's thread, off the tick.
"""

from __future__ import annotations

from daemon.responses.db import Executor


def fair_prune(tx: Executor, table: str, at: str, keep_sql: str, max_count: int,
               max_bytes: int, reserved_sql: str = "0") -> int:
    """Delete the rows of ``table`` (those where ``keep_sql`` holds; the others stay and are
    not counted) past ``max_count`` or past ``max_bytes`` of their ``size`` less
    ``reserved_sql`` (bytes held by rows that cannot go), newest by ``at`` kept first within a
    tenant and tenants served in turn. Returns how many went."""
    by_count = tx.execute(
        f"DELETE FROM {table} WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER "
        f"(ORDER BY turn, at DESC, id DESC) AS place FROM (SELECT id, {at} AS at, row_number() "
        f"OVER (PARTITION BY tenant ORDER BY {at} DESC, id DESC) AS turn FROM {table} WHERE "
        f"{keep_sql}) AS ranked) AS fair WHERE place > ?)", (max_count,)).rowcount
    by_bytes = tx.execute(
        f"DELETE FROM {table} WHERE id IN (SELECT id FROM (SELECT id, sum(size) OVER (ORDER BY "
        f"own, at DESC, id DESC ROWS UNBOUNDED PRECEDING) AS kept FROM (SELECT id, size, {at} AS "
        f"at, sum(size) OVER (PARTITION BY tenant ORDER BY {at} DESC, id DESC ROWS UNBOUNDED "
        f"PRECEDING) AS own FROM {table} WHERE {keep_sql}) AS mine) AS fair WHERE kept > ? - "
        f"({reserved_sql}))", (max_bytes,)).rowcount
    return by_count + by_bytes
