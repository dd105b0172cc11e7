"""`tether serve --tensor-parallel-size 2` on real processes: a rank that dies takes the daemon
down at once, the client gets its error, the launcher restarts the daemon and the proxy
reconnects; SIGTERM stops every rank cleanly."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.metrics import m, parse_metrics
from tests.support.raw_http import post_raw, read_events
from tests.support.serve import DRAIN_S, READY_TIMEOUT_S, Serve, gone
from tests.support.wait import free_port, wait_for

pytestmark = pytest.mark.timeout(300)

STREAM = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
          "stream": True}


def rank1(daemon: psutil.Process) -> psutil.Process:
    ranks = [c for c in daemon.children() if "daemon.model.parallel.rank" in " ".join(c.cmdline())]
    assert len(ranks) == 1, ranks
    return ranks[0]


def metrics(port: int) -> dict[str, float]:
    return parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text)


def rest_of_stream(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    rest = b""
    while not rest.endswith(b"0\r\n\r\n"):  # the chunked body's end
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return rest


def test_rank_death_restarts_the_daemon_and_sigterm_stops_every_rank(tmp_path: Path) -> None:
    serve = Serve(tmp_path, free_port(), extra=["--tensor-parallel-size", "2"])
    try:
        serve.wait_ready()
        wait_for(lambda: serve.health() == 200, 30, "/health 200")
        health = httpx.get(f"http://127.0.0.1:{serve.port}/health", timeout=5.0).json()
        assert health["tensor_parallel_size"] == 2
        daemon = serve.children()["daemon"]
        first_rank1 = rank1(daemon)

        # An abort mid-decode on the pair: evicted, its KV blocks free, in the same tick.
        sock = post_raw(serve.port, "/v1/completions", STREAM)
        read_events(sock, 3)
        sock.close()
        wait_for(lambda: m(metrics(serve.port), "tether_aborts_total",
                           cause="client_disconnect") == 1, 30, "the abort")
        after = metrics(serve.port)
        assert m(after, "tether_kv_cache_blocks_used") == 0
        assert m(after, "tether_requests_running") == 0

        # SIGKILL of rank 1 mid-stream.
        sock = post_raw(serve.port, "/v1/completions", STREAM)
        read_events(sock, 3)
        first_rank1.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        rest = rest_of_stream(sock, 10.0)
        sock.close()
        assert b'"error"' in rest and b"rank 1" in rest, rest[-400:]
        wait_for(lambda: gone(daemon), 10, "the daemon to exit")
        assert time.monotonic() - killed_at < 5.0
        wait_for(lambda: "daemon exited with status 1; restarting" in serve.log(), 10,
                 "the launcher to see the daemon fail")

        wait_for(lambda: serve.health() == 200, READY_TIMEOUT_S, "/health 200 after the restart")
        second = serve.children()
        assert second["daemon"].pid != daemon.pid
        second_rank1 = rank1(second["daemon"])
        r = httpx.post(f"http://127.0.0.1:{serve.port}/v1/completions", timeout=60.0,
                       json={"prompt": "back", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text

        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(DRAIN_S + 30) == 0
        for proc in (*second.values(), second_rank1, first_rank1):
            assert gone(proc), f"{proc.pid} outlived tether serve"
        log = serve.log()
        assert f"tensor-parallel rank 1 (pid {second_rank1.pid}) exited with status 0" in log
        assert "did not stop in time" not in log
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
            serve.proc.wait()
        print(serve.log()[-6000:])
