"""Responses API abort paths: foreground drops remove the placeholder, background ones need a cancel."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.support.metrics import m
from tests.support.pair import (
    Server,
    assert_baseline,
    check_abort,
    drop,
    new_rid,
    post_raw,
    wait_aborts,
    wait_running,
)
from tests.support.raw_http import collect_events, read_events, response_id_from_stream
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(abort_server: Server) -> Server:
    """Drops here are judged from the client's close: builtin:small's long ticks (conftest)."""
    return abort_server

LONG = {"max_output_tokens": 1500, "ignore_eos": True, "temperature": 0}


def test_streaming_response_disconnect_removes_placeholder(server: Server) -> None:
    before = server.metrics()
    sock = post_raw(server, "/v1/responses", {"input": "talk to me", "stream": True, **LONG})
    raw = read_events(sock, 8)
    rid = response_id_from_stream(raw)
    assert m(server.metrics(), "tether_conversation_placeholders") == 1
    check_abort(server, before, rid, drop(sock), sequences=1)
    with server.client() as c:
        assert c.get(f"/v1/responses/{rid}").status_code == 404


def test_non_streaming_response_disconnect_removes_placeholder(server: Server) -> None:
    before = server.metrics()
    rid = new_rid("resp")
    sock = post_raw(server, "/v1/responses", {"input": "talk to me", **LONG}, rid)
    wait_running(server)
    assert m(server.metrics(), "tether_conversation_placeholders") == 1
    check_abort(server, before, rid, drop(sock), sequences=1)
    response_id = server.request_line(rid)["rid"]  # the client never saw it: the daemon logs it
    assert response_id.startswith("resp_")
    with server.client() as c:
        assert c.get(f"/v1/responses/{response_id}").status_code == 404


def test_background_stream_survives_its_client_and_cancel_sticks(server: Server) -> None:
    """Dropped right after response.created, a background stream goes on; a foreground stream
    dropped at the same moment is the control that the proxy handled the disconnects."""
    before = server.metrics()
    background = post_raw(server, "/v1/responses", {"input": "work in the background",
                                                    "background": True, "stream": True, **LONG})
    rid = response_id_from_stream(read_events(background, 1))
    foreground = post_raw(server, "/v1/responses", {"input": "in the foreground", "stream": True,
                                                    **LONG})
    read_events(foreground, 8)
    drop(background)
    drop(foreground)
    dropped = wait_aborts(server, "client_disconnect",
                          m(before, "tether_aborts_total", cause="client_disconnect") + 1)
    # Generation goes on for many more ticks than a drop takes to be evicted (about one).
    wait_for(lambda: m(server.metrics(), "tether_generation_tokens_total")
             >= m(dropped, "tether_generation_tokens_total") + 20, 60, "20 more tokens")
    now = server.metrics()
    assert m(now, "tether_requests_running") == 1
    for figure in ("tether_aborts_total", "tether_proxy_aborts_sent_total"):
        assert m(now, figure, cause="client_disconnect") == m(
            before, figure, cause="client_disconnect") + 1, figure
        assert m(now, figure, cause="cancel") == m(before, figure, cause="cancel"), figure
    with server.client() as c:
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
        r = c.post(f"/v1/responses/{rid}/cancel")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled"
        after = wait_aborts(server, "cancel", m(before, "tether_aborts_total", cause="cancel") + 1)
        assert_baseline(after)
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        again = c.post(f"/v1/responses/{rid}/cancel")  # idempotent: still cancelled
        assert again.status_code == 200
        assert again.json()["status"] == "cancelled"


def test_every_reader_of_a_background_stream_gets_a_terminal_event_on_cancel(
        server: Server) -> None:
    events: list[list[dict[str, Any]]] = [[], [], []]
    body = {"input": "stream me", "background": True, "stream": True, **LONG}

    def read(i: int, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        collect_events(server.url, method, path, events[i], body, server.headers)

    readers = [threading.Thread(target=read, args=(0, "POST", "/v1/responses", body))]
    readers[0].start()
    wait_for(lambda: bool(events[0]), 60, "the background response is created")
    rid = events[0][0]["response"]["id"]
    # Later readers of the same stream: from its start, and from the middle.
    for i, query in ((1, ""), (2, "&starting_after=2")):
        readers.append(threading.Thread(
            target=read, args=(i, "GET", f"/v1/responses/{rid}?stream=true{query}")))
        readers[i].start()
    wait_for(lambda: all(len(e) > 4 for e in events), 60, "every reader is reading")
    with server.client() as c:
        assert c.post(f"/v1/responses/{rid}/cancel").status_code == 200
    for reader, seen in zip(readers, events, strict=True):
        reader.join(30)
        assert not reader.is_alive(), "a background stream reader hangs after cancel"
        assert seen[-1]["type"] == "response.cancelled", seen[-3:]


def test_completed_response_cannot_be_cancelled(server: Server) -> None:
    with server.client() as c:
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "ignore_eos": True,
                                          "background": True})
        rid = r.json()["id"]
        wait_for(lambda: c.get(f"/v1/responses/{rid}").json()["status"] == "incomplete", 60,
                 "background response ends (max_output_tokens reached)")
        r = c.post(f"/v1/responses/{rid}/cancel")
        assert r.status_code == 400
        assert r.json()["error"]["message"]


def test_a_dropped_custom_tool_call_stream_leaves_nothing_behind(server: Server) -> None:
    """A forced custom tool call (its input sent whole at the call's end, so the stream is
    quiet meanwhile): its grammar and placeholder go with the session, no item is stored."""
    before = server.metrics()
    body = {"input": "write a long patch", "stream": True, "max_output_tokens": 800,
            "temperature": 0, "tools": [{"type": "custom", "name": "apply_patch"}],
            "tool_choice": {"type": "custom", "name": "apply_patch"}}
    sock = post_raw(server, "/v1/responses", body)
    raw = read_events(sock, 3)
    assert b"custom_tool_call" in raw
    rid = response_id_from_stream(raw)
    wait_running(server)
    check_abort(server, before, rid, drop(sock), sequences=1)
    with server.client() as c:
        assert c.get(f"/v1/responses/{rid}").status_code == 404
