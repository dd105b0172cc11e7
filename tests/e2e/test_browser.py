"""A browser's request through CORS: its stream still aborts the moment its tab goes away, and
the access log says so."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.pair import (
    ABORT_MODEL,
    CHAT,
    Server,
    check_abort,
    drop,
    new_rid,
    post_raw,
    start_server,
)
from tests.support.raw_http import read_events
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def browser_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("cors"), [*ABORT_MODEL, "--allowed-origins", ORIGIN])
    yield s
    s.stop()


def test_a_preflight_is_answered_for_the_allowed_origin_only(browser_server: Server) -> None:
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(browser_server.url + "/v1/chat/completions",
                       headers={"Origin": ORIGIN, **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(browser_server.url + "/v1/chat/completions",
                          headers={"Origin": "https://other.example", **ask})
    assert other.status_code == 400


def test_a_browser_stream_that_goes_away_is_aborted(browser_server: Server) -> None:
    before = browser_server.metrics()
    rid = new_rid("cors")
    sock = post_raw(browser_server, "/v1/chat/completions", {**CHAT, "stream": True}, rid,
                    headers={"Origin": ORIGIN})
    head = read_events(sock, 4)
    assert f"access-control-allow-origin: {ORIGIN}".encode() in head.lower()
    check_abort(browser_server, before, rid, drop(sock), sequences=1)

    def access_lines() -> list[dict]:
        return [orjson.loads(line) for line in browser_server.log("proxy").splitlines()
                if '"logger":"tether.access"' in line and rid in line]

    wait_for(access_lines, 10, "no access log line for the dropped stream")
    [entry] = access_lines()
    assert entry["client_request_id"] == rid and entry["route"] == "/v1/chat/completions"
    assert entry["status"] == 200 and entry["client_left"] is True
