"""The Responses store off the tick (issue 36), on the real pair over PostgreSQL made slow where
it hurts (a trigger that sleeps): a slow store costs a stream beside it nothing, a turn dropped
while its history loads is evicted at once and never prefilled, and a turn is in the store by
the time its client hears it ended.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import psycopg
import pytest

from tests.support.metrics import m
from tests.support.pair import Server, assert_baseline, drop, new_rid, post_raw, start_server
from tests.support.postgres import Postgres
from tests.support.streams import Paced
from tests.support.wait import at_once, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pair(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Server, str]]:
    url = postgres.new_schema()
    s = start_server(tmp_path_factory.mktemp("store-thread"),
                     ["--model", "sim:20", "--state-url", url])
    yield s, url
    s.stop()


@contextlib.contextmanager
def slow(url: str, event: str, seconds: float, when: str | None = None) -> Iterator[None]:
    """Every row of ``event`` (INSERT, UPDATE) on responses costs the database ``seconds``."""
    name = f"slow_{uuid.uuid4().hex[:8]}"
    condition = f"WHEN ({when})" if when else ""
    with psycopg.connect(url, autocommit=True) as db:
        db.execute(f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ "
                   f"BEGIN PERFORM pg_sleep({seconds}); RETURN NEW; END $$")
        db.execute(f"CREATE TRIGGER {name} BEFORE {event} ON responses FOR EACH ROW "
                   f"{condition} EXECUTE FUNCTION {name}()")
    try:
        yield
    finally:
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(f"DROP TRIGGER {name} ON responses")
            db.execute(f"DROP FUNCTION {name}()")


def _inserting(url: str) -> bool:
    """A placeholder is being written (its INSERT waits in the trigger)."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND "
                         "query LIKE 'INSERT INTO responses %'").fetchone()
    return bool(row and row[0])


def _status(url: str, rid: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute("SELECT status FROM responses WHERE id = %s", (rid,)).fetchone()
    return None if row is None else str(row[0])


def test_a_slow_store_never_stalls_a_stream_beside_it(pair: tuple[Server, str]) -> None:
    """Each placeholder costs the database 1.2 s: the turns wait for it, the chat stream
    beside them does not (on the tick, each stalled every stream for the whole 1.2 s)."""
    server, url = pair
    with slow(url, "INSERT", 1.2):
        stream = Paced(server.url, server.headers).start()
        started = time.monotonic()

        def turn(i: int) -> httpx.Response:
            with server.client(timeout=120) as c:
                return c.post("/v1/responses", json={"input": f"turn {i}",
                                                     "max_output_tokens": 4})

        turns = at_once(3, turn)
        gap = stream.longest_gap(started)
        stream.stop()
    assert [r.status_code for r in turns] == [200] * 3, [r.text for r in turns]
    assert gap < 1.0, f"the bystander waited {gap:.2f} s while the store was slow"


def test_a_turn_dropped_while_it_loads_is_evicted_at_once_and_never_prefilled(
        pair: tuple[Server, str]) -> None:
    """Its placeholder takes the database 2 s to write; its client leaves meanwhile. The
    session is evicted within a tick or two of the close, not once the store is done; nothing
    of it is ever prefilled; and the placeholder the load wrote is removed after it."""
    server, url = pair
    before = server.metrics()
    rid = new_rid("loading")
    with slow(url, "INSERT", 2.0):
        sock = post_raw(server, "/v1/responses", {"input": "drop me while I load",
                                                  "stream": True, "max_output_tokens": 64}, rid)
        wait_for(lambda: _inserting(url), 30, "the turn's placeholder being written")
        t_close = drop(sock)
        line = server.request_line(rid)
    assert line["finish_reason"] == "abort" and line["cause"] == "client_disconnect", line
    assert 0 < line["evicted_at"] - t_close < 1.0, (t_close, line)
    assert line["last_ticks"] == [] and line["prompt_tokens"] == 0, line
    wait_for(lambda: not _inserting(url), 30, "the slow placeholder to be written")
    wait_for(lambda: _status(url, line["rid"]) is None, 10, "the placeholder to be removed")
    after = server.metrics()
    assert m(after, "tether_prompt_tokens_total") == m(before, "tether_prompt_tokens_total")
    assert_baseline(after)


def _ended(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e for e in events if e["type"] in ("response.completed",
                                                    "response.incomplete")), None)


def test_a_turn_is_in_the_store_when_its_client_hears_it_ended(
        pair: tuple[Server, str]) -> None:
    """Storing a result costs the database 0.5 s: the client hears its turn ended only once
    the row says so (read from the database, and with a GET, the moment it hears)."""
    server, url = pair
    previous = None
    with slow(url, "UPDATE", 0.5, "NEW.status IN ('completed', 'incomplete')"):
        for i in range(2):
            body: dict[str, Any] = {"input": f"turn {i}", "max_output_tokens": 8, "stream": True}
            if previous is not None:
                body["previous_response_id"] = previous
            events: list[dict[str, Any]] = []
            with httpx.stream("POST", server.url + "/v1/responses", json=body,
                              headers=server.headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(orjson.loads(line[6:]))
                        if (ended := _ended(events)) is not None:
                            break
            assert ended is not None, events[-3:]
            response = ended["response"]
            assert _status(url, response["id"]) == response["status"]
            with server.client() as c:
                got = c.get(f"/v1/responses/{response['id']}").json()
            assert got["status"] == response["status"], got
            assert got["output"] == response["output"]
            previous = response["id"]
