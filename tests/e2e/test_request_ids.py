"""A client-chosen X-Request-Id is echoed, never the engine's key: clients that pick the same id,
at once or across a proxy restart, can never refuse or abort each other's work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import stopped
from tests.support.metrics import m
from tests.support.pair import LONG, Server, post_raw, start_server, wait_aborts
from tests.support.streams import STREAM, stream_once
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)


def leave_while_in_the_pipe(server: Server, body: dict[str, Any], rid: str) -> None:
    """A completions request with X-Request-Id `rid` whose client leaves while the daemon is
    stopped (so the request is still in the pipe); returns once the daemon counted the abort."""
    with stopped(server.daemon):
        sock = post_raw(server, "/v1/completions", body, rid=rid)
        wait_for(lambda: m(server.metrics(), "tether_proxy_sessions_waiting") == 1, 10,
                 "the proxy holds the request")
        sock.close()
        wait_for(lambda: m(server.metrics(), "tether_proxy_aborts_sent_total",
                           cause="client_disconnect") == 1, 10, "the abort is written")
    wait_aborts(server, "client_disconnect", 1)


def test_two_clients_with_the_same_request_id_both_finish(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        with server.client() as c:
            first = post_raw(server, "/v1/completions", {"prompt": "one", **LONG,
                                                          "stream": True}, rid="same")
            wait_for(lambda: m(server.metrics(), "tether_requests_running") == 1, 30,
                     "the first request runs")
            r = c.post("/v1/completions", json={"prompt": "two", "max_tokens": 4},
                       headers={"X-Request-Id": "same"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "same"
            assert r.json()["id"] != "same"  # the completion's id is the server's own
            first.close()
        wait_aborts(server, "client_disconnect", 1)
    finally:
        server.stop()


def test_a_consumed_tombstone_cannot_abort_a_later_request(tmp_path: Path) -> None:
    """A request aborted while still in the pipe leaves a tombstone; a later request with the
    same X-Request-Id must run normally."""
    server = start_server(tmp_path)
    try:
        leave_while_in_the_pipe(server, {"prompt": "gone", **LONG}, rid="again")
        result = stream_once(server.url, "/v1/completions", {"prompt": "back", **STREAM},
                             headers={"X-Request-Id": "again"})
        assert result.ok, result
    finally:
        server.stop()


def test_a_reused_id_after_a_proxy_restart_cannot_abort_a_background_response(
        tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        with server.client() as c:
            r = c.post("/v1/responses", headers={"X-Request-Id": "victim"}, json={
                "input": "keep going", "background": True, "max_output_tokens": 1500,
                "ignore_eos": True, "temperature": 0})
            assert r.headers["x-request-id"] == "victim"
            response_id = r.json()["id"]
            assert response_id != "victim"  # response ids are the server's own
            wait_for(lambda: c.get(f"/v1/responses/{response_id}").json()["status"]
                     == "in_progress", 30, "the background response runs")
        server.kill("proxy")
        server.start_proxy()
        server.wait_health(200)
        # Another client picks the same X-Request-Id and leaves before the daemon answers it.
        leave_while_in_the_pipe(server, {"prompt": "x", **LONG, "stream": True}, rid="victim")
        with server.client() as c:
            assert c.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress"
            wait_for(lambda: c.get(f"/v1/responses/{response_id}").json()["status"]
                     != "in_progress", 120, "the background response ends")
            body = c.get(f"/v1/responses/{response_id}").json()
        assert body["status"] == "incomplete" and body["usage"]["output_tokens"] == 1500, body
    finally:
        server.stop()
