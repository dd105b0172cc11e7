"""What a replica does for a shared store off its tick thread: hold its lease, end the responses
of replicas whose lease ran out, learn of cancels aimed at it, prune responses and conversations
(by age, count and bytes).

The tick never waits on this: the watcher runs in its own thread with its own connection and hands
cancelled response ids over through a queue, which the tick drains at its start. On PostgreSQL it
sleeps in LISTEN and wakes on the NOTIFY that a cancel sends; on SQLite (pairs on one machine) it
polls every 100 ms, a read that WAL mode never blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from daemon.responses.conversations import Conversations
from daemon.responses.db import Database, Listener
from daemon.responses.item_index import SWEEP_SQL
from daemon.responses.retention import fair_prune
from daemon.responses.rows import PLACEHOLDERS_SQL, text_column
from ipc.response_records import ResponseStatus

log = logging.getLogger("tether.store")

OWNER_LOST_MESSAGE = "The replica running this response stopped before it finished."
POLL_S = 0.1  # the bound on how late an owner learns of a cancel (SQLite; PostgreSQL's backstop)
LISTEN_BACKSTOP_S = 0.5  # PostgreSQL: a NOTIFY lost across a reconnect is found by this poll


class Watcher:
    """One replica's housekeeping on one connection; `start` runs it in a thread."""

    def __init__(self, db: Database, replica_id: str, lease_s: float,
                 cancels: queue.SimpleQueue[str], *, max_count: int, max_age_s: float,
                 max_bytes: int, clock: Callable[[], float] = time.time,
                 conversations: Conversations | None = None) -> None:
        self.db = db
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.cancels = cancels
        self.max_count = max_count
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.conversations = conversations
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one pass of each duty ---------------------------------------------------------------------

    def renew(self) -> None:
        self.db.execute(
            "INSERT INTO replicas (replica_id, lease_until) VALUES (?, ?) ON CONFLICT "
            "(replica_id) DO UPDATE SET lease_until = excluded.lease_until",
            (self.replica_id, self.clock() + self.lease_s))

    def release(self) -> None:
        """A clean stop: nothing of ours is left running, so no one need wait out the lease."""
        self.db.execute("DELETE FROM replicas WHERE replica_id = ?", (self.replica_id,))

    def poll_cancels(self) -> int:
        ids = [r["response_id"] for r in self.db.execute(
            "SELECT response_id FROM cancel_requests WHERE owner = ?", (self.replica_id,)).rows]
        for rid in ids:
            self.db.execute("DELETE FROM cancel_requests WHERE response_id = ?", (rid,))
            self.cancels.put(rid)
        return len(ids)

    def sweep(self) -> int:
        """End the unfinished responses of every replica whose lease has run out."""
        dead = [r["replica_id"] for r in self.db.execute(
            "SELECT replica_id FROM replicas WHERE lease_until < ? AND replica_id <> ?",
            (self.clock(), self.replica_id)).rows]
        ended = 0
        for owner in dead:
            with self.db.transaction() as tx:
                n = 0
                # Background responses become failed, so a poller sees an end; foreground ones
                # go, as their clients went with the replica.
                n += tx.execute(
                    f"UPDATE responses SET status = ?, error = ? WHERE owner = ? AND background = 1"
                    f" AND status IN {PLACEHOLDERS_SQL}",
                    (ResponseStatus.FAILED.value, text_column(OWNER_LOST_MESSAGE), owner)).rowcount
                n += tx.execute(
                    f"DELETE FROM responses WHERE owner = ? AND background = 0 AND status IN "
                    f"{PLACEHOLDERS_SQL}", (owner,)).rowcount
                tx.execute("DELETE FROM cancel_requests WHERE owner = ?", (owner,))
                tx.execute("DELETE FROM replicas WHERE replica_id = ? AND lease_until < ?",
                           (owner, self.clock()))
            ended += n
            log.warning("replica %s lost its lease; ended its %d unfinished responses", owner, n)
        return ended

    def prune(self) -> int:
        """Drop finished responses beyond ``max_age_s``, ``max_count`` or ``max_bytes``, oldest
        first and fairly between tenants (retention.py). The bytes of unfinished ones count
        towards ``max_bytes``, but they stay."""
        finished = f"status NOT IN {PLACEHOLDERS_SQL}"
        with self.db.transaction() as tx:
            by_age = tx.execute(f"DELETE FROM responses WHERE stored_at < ? AND {finished}",
                                (self.clock() - self.max_age_s,)).rowcount
            by_bounds = fair_prune(tx, "responses", "stored_at", finished, self.max_count,
                                   self.max_bytes, "SELECT coalesce(sum(size), 0) FROM "
                                   f"responses WHERE status IN {PLACEHOLDERS_SQL}")
            tx.execute(SWEEP_SQL)  # the index entries of every response deleted since
        return by_age + by_bounds

    def housekeep(self) -> None:
        self.renew()
        self.sweep()
        self.prune()
        if self.conversations is not None:
            self.conversations.prune()  # and recount them for /metrics

    # --- the thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self.housekeep()  # hold the lease before the first response begins
        self._thread = threading.Thread(target=self._run, name="tether-store-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        listener: Listener | None = None
        next_housekeep = self.clock() + self.lease_s / 3
        while not self._stop.is_set():
            try:
                if listener is None:
                    listener = self.db.listen()
                if self.clock() >= next_housekeep:
                    self.housekeep()
                    next_housekeep = self.clock() + self.lease_s / 3
                self.poll_cancels()
                if listener is None:
                    self._stop.wait(POLL_S)
                else:
                    listener.wait(LISTEN_BACKSTOP_S)
            except Exception as e:  # the store is away: say so, keep trying, never kill the tick
                log.warning("response store housekeeping failed: %s", e)
                if listener is not None:
                    _close_quietly(listener)
                    listener = None
                self._stop.wait(1.0)
        if listener is not None:
            _close_quietly(listener)


def _close_quietly(listener: Listener) -> None:
    try:
        listener.close()
    except Exception:
        pass
