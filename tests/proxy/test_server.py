"""The abort paths on a real uvicorn port, against the scripted daemon on real FIFOs.

Clients are raw sockets so that a test controls exactly when the connection goes away.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest

from ipc.records import AbortCause
from proxy.options import ProxyOptions
from tests.support.live_proxy import LiveProxy, settle, start_live, stop_live
from tests.support.peer import Peer
from tests.support.raw_http import post_raw, read_events, read_plain, read_to_end

pytestmark = pytest.mark.timeout(60)

ENDLESS = {"max_tokens": 4000}  # 20 s of tokens at the peer's pace: longer than any test
CHAT = {"messages": [{"role": "user", "content": "go on"}], **ENDLESS}


def assert_one_abort(peer: Peer, client_id: str, settled: Callable[[], None],
                     cause: AbortCause = AbortCause.CLIENT_DISCONNECT) -> None:
    """Exactly one Abort for the request; `settled` is the barrier after which a duplicate
    would show."""
    rid = peer.key_of(client_id)
    peer.wait_for(lambda p: any(a.rid == rid for a in p.aborts))
    settled()
    aborts = [a for a in peer.aborts if a.rid == rid]
    assert len(aborts) == 1, aborts
    assert aborts[0].cause is cause
    assert cause is not AbortCause.CLIENT_DISCONNECT or aborts[0].t_disconnect is not None


def open_sessions(live: LiveProxy) -> int:
    return int(live.server.app.state.engine.num_sessions)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "stream": True, **ENDLESS}),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
])
def test_streaming_disconnect_writes_one_abort(live: LiveProxy, peer: Peer, path: str,
                                               body: dict[str, Any]) -> None:
    sock = post_raw(live.port, path, body, "s-drop")
    read_events(sock, 6)
    sock.close()
    assert_one_abort(peer, "s-drop", lambda: settle(live))
    assert open_sessions(live) == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_writes_an_abort(live: LiveProxy, peer: Peer,
                                                  path: str) -> None:
    body = {"prompt": "p", **ENDLESS} if path == "/v1/completions" else CHAT
    sock = post_raw(live.port, path, body, "n-drop")
    peer.wait_for(lambda p: p.produced("n-drop") >= 3)  # it runs a few steps first
    sock.close()
    assert_one_abort(peer, "n-drop", lambda: settle(live))
    assert open_sessions(live) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_queued_disconnect_writes_an_abort(live: LiveProxy, peer: Peer, stream: bool) -> None:
    peer.hold = True
    sock = post_raw(live.port, "/v1/completions", {"prompt": "p", "stream": stream, **ENDLESS},
                    "q-drop")
    peer.wait_for(lambda p: any(s.client_id == "q-drop" for s in p.submits))
    sock.close()
    assert_one_abort(peer, "q-drop", lambda: settle(live))
    assert open_sessions(live) == 0


def test_normal_finish_writes_no_abort(live: LiveProxy, peer: Peer) -> None:
    with httpx.Client(base_url=live.url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": "p", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/v1/chat/completions",
                      json={**CHAT, "max_tokens": 5, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        # A client that reads the last event and hangs up at once is not an abort either.
        sock = post_raw(live.port, "/v1/completions", {"prompt": "p", "max_tokens": 2,
                                                       "stream": True}, "quick")
        read_events(sock, 3)
        sock.close()
    settle(live)
    assert peer.aborts == []
    assert open_sessions(live) == 0


def test_auth_on_still_aborts(options: ProxyOptions, peer: Peer) -> None:
    options = dataclasses.replace(options, api_keys=("sk-test",))
    live = start_live(options)
    try:
        peer.wait_for(lambda p: bool(live.server.app.state.engine.up))
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "p"})
        assert r.status_code == 401
        sock = post_raw(live.port, "/v1/chat/completions", {**CHAT, "stream": True}, "a-s",
                        key="sk-test")
        read_events(sock, 3)
        sock.close()
        assert_one_abort(peer, "a-s", lambda: settle(live, "sk-test"))
        sock = post_raw(live.port, "/v1/completions", {"prompt": "p", **ENDLESS}, "a-n",
                        key="sk-test")
        peer.wait_for(lambda p: any(s.client_id == "a-n" for s in p.submits))
        sock.close()
        assert_one_abort(peer, "a-n", lambda: settle(live, "sk-test"))
    finally:
        stop_live(live)


def test_daemon_lost_ends_streams_with_an_error_and_health_503(live: LiveProxy,
                                                               peer: Peer) -> None:
    stream = post_raw(live.port, "/v1/completions", {"prompt": "p", "stream": True, **ENDLESS},
                      "lost-s")
    read_events(stream, 3)
    plain = post_raw(live.port, "/v1/completions", {"prompt": "p", **ENDLESS}, "lost-n")
    peer.wait_for(lambda p: any(s.client_id == "lost-n" for s in p.submits))
    started = time.monotonic()
    peer.stop()
    rest = read_to_end(stream)
    assert time.monotonic() - started < 3.0
    last = rest.split(b"data: ")[-1]
    assert b'"error"' in last and b"[DONE]" not in rest
    status, body = read_plain(plain)
    assert b" 503 " in status and orjson.loads(body)["error"]["code"] == "engine_unavailable"
    assert httpx.get(live.url + "/health").status_code == 503
    assert open_sessions(live) == 0


def test_ready_status_and_watchdog_notifications(live: LiveProxy) -> None:
    """Pings from the start; READY=1 once the daemon is connected, after a status that said
    the proxy waited for it (tests/tether/test_units.py runs this against a real daemon)."""
    ready = live.notes.index("READY=1")
    assert live.notes.index(f"STATUS=listening on 127.0.0.1:{live.port}, waiting for the "
                            "daemon") < live.notes.index(
        f"STATUS=listening on 127.0.0.1:{live.port}") < ready
    assert live.notes[0].startswith("WATCHDOG=1\nEXTEND_TIMEOUT_USEC=")


def test_shutdown_aborts_what_is_left_and_leaks_no_task(
        options: ProxyOptions, peer: Peer, caplog: pytest.LogCaptureFixture) -> None:
    options = dataclasses.replace(options, drain_timeout_s=0.2)
    live = start_live(options)
    peer.wait_for(lambda p: bool(live.server.app.state.engine.up))
    sock = post_raw(live.port, "/v1/completions", {"prompt": "p", "stream": True, **ENDLESS},
                    "shut")
    read_events(sock, 2)
    with caplog.at_level(logging.WARNING):
        stop_live(live)
    # The proxy is gone: its Goodbye, the last record it writes, is the barrier.
    assert_one_abort(peer, "shut", lambda: peer.wait_for(lambda p: bool(p.goodbyes)),
                     AbortCause.SHUTDOWN)
    assert b'"error"' in read_to_end(sock)
    assert "STOPPING=1" in live.notes
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


SMALL_PROXY = """
import sys
from collections.abc import Callable
from pathlib import Path
from proxy.server import run
from tether.options import proxy_options
from tether.settings import Settings
heavy = [m for m in ("torch", "tokenizers", "transformers", "daemon") if m in sys.modules]
assert not heavy, heavy
code = run(proxy_options(Settings(runtime_dir=Path(sys.argv[1]), port=0)),
           notify=lambda m: print(m, flush=True))
heavy = [m for m in ("torch", "tokenizers", "transformers", "daemon") if m in sys.modules]
print("HEAVY", heavy, flush=True)
sys.exit(code)
"""


def test_process_is_small_and_stops_on_sigterm(tmp_path: Path) -> None:
    """What makes the proxy start fast is asserted, not a wall-clock time that a busy machine
    stretches: it never imports torch, tokenizers, transformers or the daemon."""
    proc = subprocess.Popen([sys.executable, "-c", SMALL_PROXY, str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout is not None
        lines = [""]
        # No daemon: listening and pinging, but never READY=1.
        while not lines[-1].startswith("STATUS=listening on"):
            line = proc.stdout.readline()
            assert line, "the proxy exited before it was listening"
            lines.append(line.strip())
        rss_mb = psutil.Process(proc.pid).memory_info().rss / 2**20
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "HEAVY []" in out and "STOPPING=1" in out
    assert rss_mb <= 60, rss_mb
