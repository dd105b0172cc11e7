"""Responses API abort paths: foreground drops remove the placeholder, background ones need a cancel."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import orjson
import pytest

from tests.support.metrics import m
from tests.support.pair import (
    Server,
    assert_baseline,
    check_abort,
    drop,
    post_raw,
    wait_aborts,
    wait_running,
)
from tests.support.raw_http import read_events, response_id_from_stream
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

LONG = {"max_output_tokens": 1500, "ignore_eos": True, "temperature": 0}


def test_streaming_response_disconnect_removes_placeholder(server: Server) -> None:
    before = server.metrics()
    sock = post_raw(server, "/v1/responses", {"input": "talk to me", "stream": True, **LONG})
    raw = read_events(sock, 8)
    rid = response_id_from_stream(raw)
    assert m(server.metrics(), "tether_conversation_placeholders") == 1
    drop(sock)
    check_abort(server, before, "client_disconnect", sequences=1)
    with server.client() as c:
        assert c.get(f"/v1/responses/{rid}").status_code == 404


def test_non_streaming_response_disconnect_removes_placeholder(server: Server) -> None:
    before = server.metrics()
    sock = post_raw(server, "/v1/responses", {"input": "talk to me", **LONG})
    wait_running(server)
    assert m(server.metrics(), "tether_conversation_placeholders") == 1
    drop(sock)
    check_abort(server, before, "client_disconnect", sequences=1)


def test_background_response_survives_disconnect_and_cancel_sticks(server: Server) -> None:
    before = server.metrics()
    sock = post_raw(server, "/v1/responses", {"input": "work in the background",
                                              "background": True, **LONG})
    head = b""
    while b"\r\n\r\n" not in head or not head.rstrip().endswith(b"}"):
        head += sock.recv(65536)
    rid = orjson.loads(head.split(b"\r\n\r\n", 1)[1])["id"]
    drop(sock)
    wait_running(server)
    with server.client() as c:
        assert c.get(f"/v1/responses/{rid}").json()["status"] in ("queued", "in_progress")
        assert m(server.metrics(), "tether_aborts_total", cause="client_disconnect") == m(
            before, "tether_aborts_total", cause="client_disconnect")

        r = c.post(f"/v1/responses/{rid}/cancel")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled"
        after = wait_aborts(server, "cancel", m(before, "tether_aborts_total", cause="cancel") + 1)
        assert_baseline(after)
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        again = c.post(f"/v1/responses/{rid}/cancel")  # idempotent: still cancelled
        assert again.status_code == 200
        assert again.json()["status"] == "cancelled"


def test_background_stream_reader_gets_terminal_event_on_cancel(server: Server) -> None:
    events: list[str] = []
    rid_box: list[str] = []

    def read() -> None:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
            body: dict[str, Any] = {"input": "stream me", "background": True, "stream": True, **LONG}
            with c.stream("POST", "/v1/responses", json=body) as s:
                for line in s.iter_lines():
                    if line.startswith("event: "):
                        events.append(line[7:])
                    if line.startswith("data: ") and not rid_box and "response.created" in line:
                        rid_box.append(orjson.loads(line[6:])["response"]["id"])

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: len(events) > 6, 60, "background stream events")
    with server.client() as c:
        assert c.post(f"/v1/responses/{rid_box[0]}/cancel").status_code == 200
    reader.join(30)
    assert not reader.is_alive(), "the background stream reader hangs after cancel"
    assert events[-1] == "response.cancelled", events[-5:]


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
