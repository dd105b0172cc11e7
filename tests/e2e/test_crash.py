"""A process dies with sessions running: nothing is orphaned and nobody hangs."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support.metrics import m
from tests.support.pair import LONG, assert_baseline, post_raw, start_server, wait_aborts
from tests.support.raw_http import read_events
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)


def test_proxy_crash_evicts_its_sessions(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        socks = [post_raw(server, "/v1/completions",
                          {"prompt": f"stream {i}", "stream": True, **LONG}) for i in range(3)]
        for s in socks:
            read_events(s, 3)
        assert m(server.metrics(), "tether_requests_running") == 3
        server.kill("proxy")
        killed_at = time.monotonic()
        for s in socks:
            s.close()
        daemon_log = tmp_path / "daemon.log"
        wait_for(lambda: "proxy_lost" in daemon_log.read_text(errors="replace"), 10,
                 "the daemon notices the proxy is gone")
        assert time.monotonic() - killed_at < 5.0  # generous: the bound asserted below is in ticks
        server.start_proxy()
        server.wait_health(200)
        after = wait_aborts(server, "proxy_lost", 3)  # the new proxy's first Stats
        assert m(after, "tether_aborts_total", cause="proxy_lost") == 3
        assert_baseline(after)
    finally:
        server.stop()


def test_daemon_crash_fails_clients_and_proxy_recovers(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        sock = post_raw(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG})
        read_events(sock, 3)
        server.kill("daemon")
        sock.settimeout(10)
        rest = b""
        started = time.monotonic()
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
            if rest.endswith(b"0\r\n\r\n"):  # the chunked body ended
                break
        assert time.monotonic() - started < 5.0
        assert b'"error"' in rest, rest[-300:]
        sock.close()
        wait_for(lambda: server.health() == 503, 10, "/health 503 while the daemon is down")

        server.start_daemon()
        server.wait_health(200)
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": "back", "max_tokens": 3,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
    finally:
        server.stop()


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_background_response_outlives_a_proxy_restart(tmp_path: Path, stop: str) -> None:
    """Neither a graceful stop nor a crash of the proxy aborts a background response: the daemon
    goes on with it and stores the result, which the next proxy serves. (A short drain: the
    stop must not wait for the response either.)"""
    server = start_server(tmp_path, ["--drain-timeout-s", "0.2"])
    try:
        with server.client() as c:
            rid = c.post("/v1/responses", json={"input": "keep going", "background": True,
                                                "max_output_tokens": 1500, "ignore_eos": True,
                                                "temperature": 0}).json()["id"]
            wait_for(lambda: c.get(f"/v1/responses/{rid}").json()["status"] == "in_progress", 30,
                     "the background response runs")
        if stop == "sigkill":
            server.kill("proxy")
        else:
            assert server.proxy is not None
            stopping = time.monotonic()
            server.proxy.send_signal(signal.SIGTERM)
            assert server.proxy.wait(30) == 0
            assert time.monotonic() - stopping < 5.0  # generous; the response needs longer
        server.start_proxy()
        server.wait_health(200)
        with server.client() as c:
            assert c.get(f"/v1/responses/{rid}").json()["status"] in ("in_progress", "incomplete")
            wait_for(lambda: c.get(f"/v1/responses/{rid}").json()["status"] != "in_progress", 60,
                     "the background response ends")
            body = c.get(f"/v1/responses/{rid}").json()
        assert body["status"] == "incomplete", body
        assert body["usage"]["output_tokens"] == 1500 and body["output"][0]["content"][0]["text"]
        after = server.metrics()
        assert sum(m(after, "tether_aborts_total", cause=cause)
                   for cause in ("client_disconnect", "cancel", "proxy_lost", "shutdown")) == 0
        assert_baseline(after)
    finally:
        server.stop()
