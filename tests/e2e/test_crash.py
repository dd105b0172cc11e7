"""A process dies with sessions running: the other one sees EOF at once, nothing is orphaned and
nobody hangs. Background responses outlive the proxy, stopped or killed."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.metrics import m
from tests.support.pair import (
    LONG,
    Server,
    assert_baseline,
    new_rid,
    post_raw,
    start_server,
    wait_aborts,
    wait_running,
)
from tests.support.raw_http import collect_events, read_events, read_plain, read_to_end
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)

# EOF (or EPIPE) is seen at once; the heartbeat fallback would take 3 s. Generous for a busy machine, and
# still a third of the fallback.
EOF_DETECTION_S = 1.0


def lost_reasons(server: Server, which: str, prefix: str) -> list[str]:
    return [x["msg"] for x in server.log_lines(which) if x["msg"].startswith(prefix)]


def test_proxy_crash_evicts_its_sessions(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        rids = [new_rid("crash") for _ in range(3)]
        socks = [post_raw(server, "/v1/completions",
                          {"prompt": f"stream {i}", "stream": True, **LONG}, rid)
                 for i, rid in enumerate(rids)]
        for s in socks:
            read_events(s, 3)
        assert m(server.metrics(), "tether_requests_running") == 3
        killed_at = server.signal("proxy", signal.SIGKILL)
        for s in socks:
            s.close()
        for rid in rids:
            line = server.request_line(rid)
            assert line["cause"] == "proxy_lost", line
            assert line["evicted_at"] - killed_at < EOF_DETECTION_S, (killed_at, line)
        # The kernel's word, not the heartbeat fallback: EOF reading control or requests, or
        # EPIPE writing tokens, whichever the daemon touched first.
        [reason] = lost_reasons(server, "daemon", "proxy lost (")
        assert "(EOF)" in reason or "(EPIPE)" in reason, reason
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
        stream = post_raw(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG})
        read_events(stream, 3)
        plain = post_raw(server, "/v1/completions", {"prompt": "wait for me", **LONG})
        wait_running(server, 2)
        stream.settimeout(10)
        plain.settimeout(10)
        killed_at = server.signal("daemon", signal.SIGKILL)
        rest = read_to_end(stream)
        status, body = read_plain(plain)
        assert time.monotonic() - killed_at < EOF_DETECTION_S
        assert b'"error"' in rest.split(b"data: ")[-1] and b"[DONE]" not in rest, rest[-300:]
        assert b" 503 " in status and orjson.loads(body)["error"]["code"] == "engine_unavailable"
        [reason] = lost_reasons(server, "proxy", "ipc: daemon lost: ")
        assert "(EOF)" in reason, reason
        assert server.health() == 503
        stream.close()
        plain.close()

        server.start_daemon()
        server.wait_health(200)
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": "back", "max_tokens": 3,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
    finally:
        server.stop()


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_background_responses_outlive_a_proxy_restart(tmp_path: Path, stop: str) -> None:
    """Neither a graceful stop nor a crash of the proxy aborts a background response: the daemon
    goes on with it and stores the result, which the next proxy serves, and the next proxy can
    cancel one the previous one started. Readers on a stopping proxy are told so. (One sequence
    at a time, so the second response waits behind the first; a short drain: the stop must not
    wait for either.)"""
    server = start_server(tmp_path, ["--drain-timeout-s", "0.2", "--max-num-seqs", "1"])
    body = {"background": True, "max_output_tokens": 1500, "ignore_eos": True, "temperature": 0}
    events: list[dict[str, Any]] = []
    try:
        with server.client() as c:
            first = c.post("/v1/responses", json={"input": "keep going", **body}).json()["id"]
            second = c.post("/v1/responses", json={"input": "wait your turn", **body}).json()["id"]
            wait_for(lambda: c.get(f"/v1/responses/{first}").json()["status"] == "in_progress",
                     30, "the first background response runs")
        reader = threading.Thread(target=collect_events, args=(
            server.url, "GET", f"/v1/responses/{first}?stream=true", events))
        reader.start()
        wait_for(lambda: len(events) > 3, 30, "a reader of the first response's stream")
        if stop == "sigkill":
            server.kill("proxy")
        else:
            assert server.proxy is not None
            stopping = time.monotonic()
            server.proxy.send_signal(signal.SIGTERM)
            assert server.proxy.wait(30) == 0
            assert time.monotonic() - stopping < 5.0  # generous; the response needs longer
            reader.join(10)
            assert not reader.is_alive()
            assert events[-1]["type"] == "error", events[-3:]
            assert events[-1]["code"] == "server_restarting" and first in events[-1]["message"]
        server.start_proxy()
        server.wait_health(200)
        with server.client() as c:
            cancelled = c.post(f"/v1/responses/{second}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            wait_for(lambda: c.get(f"/v1/responses/{first}").json()["status"] != "in_progress", 60,
                     "the first background response ends")
            done = c.get(f"/v1/responses/{first}").json()
            assert c.get(f"/v1/responses/{second}").json()["status"] == "cancelled"
        assert done["status"] == "incomplete", done
        assert done["usage"]["output_tokens"] == 1500 and done["output"][0]["content"][0]["text"]
        after = wait_aborts(server, "cancel", 1)
        assert sum(m(after, "tether_aborts_total", cause=cause)
                   for cause in ("client_disconnect", "proxy_lost", "shutdown")) == 0
        assert_baseline(after)
    finally:
        server.stop()
        reader.join(10)
