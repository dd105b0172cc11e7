"""Faults on the pipes between the real proxy and the real daemon: a client that leaves in the
middle of a large upload, a connection that breaks in the middle of a frame, a daemon that never
answers, stale requests of an earlier connection, and a peer that speaks another protocol."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from ipc.records import PROTOCOL_VERSION
from tests.support.faults import fifo_pending, stopped
from tests.support.metrics import m
from tests.support.pair import (
    LONG,
    Server,
    assert_baseline,
    post_raw,
    start_server,
    wait_aborts,
    wait_running,
)
from tests.support.streams import STREAM, Bystanders
from tests.support.wait import free_port, wait_for

pytestmark = pytest.mark.timeout(240)

# A completions body of ~3 MB: its Submit frame is three times what the requests pipe holds, so
# it is written in pieces, each after the daemon has read the one before.
BIG = {"prompt": "x" * 3_000_000, "max_tokens": 1}


def test_a_client_leaving_mid_upload_hurts_nobody(tmp_path: Path) -> None:
    server = start_server(tmp_path, ["--max-num-seqs", "8"])
    try:
        others = Bystanders(server.url, 4, body={"prompt": "a bystander", **STREAM,
                                                 "max_tokens": 1000}).start()
        wait_running(server, 4)
        for _ in range(4):
            # The whole body goes out, then the socket closes: the proxy sees the disconnect
            # while it is writing the request's frame into the pipe.
            post_raw(server, "/v1/completions", BIG).close()
        others.assert_all_ok()
        after = server.metrics()
        assert m(after, "tether_aborts_total", cause="proxy_lost") == 0
        assert m(after, "tether_ipc_bad_records_total", pipe="requests") == 0
        assert "daemon lost" not in server.log("proxy")
    finally:
        server.stop()


def test_a_new_connection_resyncs_after_a_half_written_frame(tmp_path: Path) -> None:
    """A proxy killed in the middle of a frame leaves half of it in the requests pipe; the next
    proxy's first request must not be glued to it."""
    server = start_server(tmp_path)
    requests_fifo = tmp_path / "run" / "requests"
    try:
        with stopped(server.daemon):
            sock = post_raw(server, "/v1/completions", BIG)
            wait_for(lambda: fifo_pending(requests_fifo) >= 512 * 1024, 20,
                     "half a frame in the requests pipe")
            server.kill("proxy")
            sock.close()
            server.start_proxy()
            wait_for(lambda: server.log("proxy").count("pipes open") >= 2, 60,
                     "the new proxy opens the pipes")
        server.wait_health(200)
        with server.client(timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "after", "max_tokens": 3})
        assert r.status_code == 200, r.text
        # The stale half frame is what was skipped, as one bad record; nothing else was lost.
        assert m(server.metrics(), "tether_ipc_bad_records_total", pipe="requests") == 1
    finally:
        server.stop()


def test_a_request_the_daemon_never_answers_times_out(tmp_path: Path) -> None:
    server = start_server(tmp_path, ["--request-timeout-s", "1"])
    statuses: dict[str, tuple[int, str]] = {}

    def ask(name: str, body: dict[str, object]) -> None:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        statuses[name] = (r.status_code, r.text)

    try:
        threads = [threading.Thread(target=ask, args=(name, body)) for name, body in (
            ("plain", {"prompt": "hello", "max_tokens": 3}),
            ("stream", {"prompt": "hello", "max_tokens": 3, "stream": True}))]
        with stopped(server.daemon):
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
        # A 504, not the 503 of the 3 s silence bound: the deadline ended them.
        assert sorted(statuses) == ["plain", "stream"]
        for name, (status, text) in statuses.items():
            assert status == 504, (name, status, text)
            assert '"code":"timeout"' in text.replace(" ", "")
        # The daemon read each Abort before its Submit: both count as aborted with cause timeout.
        after = wait_aborts(server, "timeout", 2)
        assert m(after, "tether_proxy_aborts_sent_total", cause="timeout") == 2
        assert m(after, "tether_requests_finished_total", reason="abort") == 2
        assert_baseline(after)
        assert server.health() == 200
    finally:
        server.stop()


def test_stale_submits_are_refused_after_a_new_epoch(tmp_path: Path) -> None:
    """Requests still in the pipe when the proxy reconnected belong to clients it already failed:
    the daemon must not run them for nobody."""
    server = start_server(tmp_path)
    try:
        with stopped(server.daemon):
            socks = [post_raw(server, "/v1/completions", {"prompt": f"stale {i}", **LONG})
                     for i in range(3)]
            wait_for(lambda: fifo_pending(tmp_path / "run" / "requests") > 0, 10,
                     "the requests in the pipe")
            # 3 s of silence: the proxy fails its clients and reconnects on a new epoch.
            wait_for(lambda: server.log("proxy").count("pipes open") >= 2, 20,
                     "the proxy reconnects")
        server.wait_health(200)
        after = wait_aborts(server, "proxy_lost", 3)
        assert m(after, "tether_requests_running") == 0
        time.sleep(0.5)
        assert m(server.metrics(), "tether_generation_tokens_total") == m(
            after, "tether_generation_tokens_total")
        assert_baseline(server.metrics())
        for sock in socks:
            sock.close()
    finally:
        server.stop()


_EPOCH = re.compile(r"proxy pid \d+ connected: epoch (\d+)")


def test_epochs_strictly_increase_across_restarts(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        for _ in range(2):
            server.kill("proxy")
            server.start_proxy()
            server.wait_health(200)
        server.kill("daemon")
        server.start_daemon()  # a new daemon continues the count it kept in the runtime dir
        server.wait_health(200)
        epochs = [int(e) for e in _EPOCH.findall(server.log("daemon"))]
        assert len(epochs) == 4 and epochs == sorted(set(epochs)), epochs
    finally:
        server.stop()


@pytest.mark.parametrize("newer", ["daemon", "proxy"])
def test_a_protocol_mismatch_is_visible(tmp_path: Path, newer: str) -> None:
    other = PROTOCOL_VERSION + 97
    server = Server(tmp_path, free_port())
    server.start_daemon(other if newer == "daemon" else None)
    server.start_proxy(other if newer == "proxy" else None)
    try:
        reason = ""

        def mismatch_reported() -> bool:
            nonlocal reason
            try:
                r = httpx.get(server.url + "/health", timeout=2)
            except httpx.HTTPError:
                return False
            reason = r.json().get("reason", "")
            return r.status_code == 503 and "protocol" in reason

        wait_for(mismatch_reported, 120, f"/health naming the mismatch\n{server.logs()}")
        ours, theirs = (other, PROTOCOL_VERSION) if newer == "proxy" else (PROTOCOL_VERSION, other)
        assert f"proxy {ours}" in reason and f"daemon {theirs}" in reason, reason
        assert f"daemon {theirs}" in server.log("proxy") and f"proxy {ours}" in server.log("proxy")
    finally:
        server.stop()
