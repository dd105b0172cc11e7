"""A store too slow for its clients (issue 34, item 15), on the real pair over PostgreSQL: every
item a conversation gains costs the database a second (a trigger that sleeps), so appends sent
together wait past the proxy's patience. Each append answered 503 was not applied, each
answered 200 was, and a client that retries its 503s stores each of its items exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import psycopg
import pytest

from tests.support.pair import Server, start_server
from tests.support.postgres import Postgres
from tests.support.wait import at_once

pytestmark = pytest.mark.timeout(300)

SLOW_S = 1.0  # what each inserted item costs the database
APPENDS = 8  # together: the last ones wait past the proxy's 5 s


@pytest.fixture
def pair(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Server, str]]:
    url = postgres.new_schema()
    s = start_server(tmp_path_factory.mktemp("slow-store"),
                     ["--model", "sim:20", "--state-url", url])
    yield s, url
    s.stop()


def _slow(url: str, on: bool) -> None:
    with psycopg.connect(url, autocommit=True) as db:
        if on:
            db.execute("CREATE FUNCTION slow_item() RETURNS trigger LANGUAGE plpgsql AS $$ "
                       f"BEGIN PERFORM pg_sleep({SLOW_S}); RETURN NEW; END $$")
            db.execute("CREATE TRIGGER slow BEFORE INSERT ON conversation_items FOR EACH ROW "
                       "EXECUTE FUNCTION slow_item()")
        else:
            db.execute("DROP TRIGGER slow ON conversation_items")


def test_an_append_answered_503_was_not_applied_and_a_retry_stores_it_once(
        pair: tuple[Server, str]) -> None:
    server, url = pair
    with server.client() as c:
        cid = c.post("/v1/conversations", json={}).json()["id"]
    _slow(url, on=True)

    def append(i: int) -> httpx.Response:
        with server.client(timeout=120) as c:
            return c.post(f"/v1/conversations/{cid}/items",
                          json={"items": [{"role": "user", "content": f"item {i}"}]})

    first = at_once(APPENDS, append)
    statuses = [r.status_code for r in first]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 3, statuses
    for r in first:
        if r.status_code == 503:
            assert "not applied" in r.json()["error"]["message"], r.text
    _slow(url, on=False)
    with server.client() as c:
        listed = c.get(f"/v1/conversations/{cid}/items", params={"limit": 100, "order": "asc"})
        stored = [item["content"][0]["text"] for item in listed.json()["data"]]
        assert sorted(stored) == sorted(f"item {i}" for i, s in enumerate(statuses) if s == 200)
        for i, status in enumerate(statuses):  # the client retries what it was told failed
            if status == 503:
                assert append(i).status_code == 200
        listed = c.get(f"/v1/conversations/{cid}/items", params={"limit": 100, "order": "asc"})
    stored = [item["content"][0]["text"] for item in listed.json()["data"]]
    assert sorted(stored) == sorted(f"item {i}" for i in range(APPENDS))
