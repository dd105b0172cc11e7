"""The real daemon and proxy processes on real FIFOs and a real port, and the checks that every
abort test makes on them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support import raw_http
from tests.support.metrics import m, parse_metrics
from tests.support.wait import free_port, wait_for

READY_TIMEOUT_S = 120.0


@dataclass
class Server:
    tmp: Path
    port: int
    extra: list[str] = field(default_factory=list)
    api_key: str | None = None
    daemon: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _cmd(self, what: str, protocol_version: int | None = None) -> list[str]:
        run = [sys.executable, "-m", "tether.cli"]
        if protocol_version is not None:
            # A build that speaks another protocol version: the real program, with the constant
            # changed before anything reads it.
            run = [sys.executable, "-c", f"import ipc.records; ipc.records.PROTOCOL_VERSION = "
                   f"{protocol_version}; import sys; from tether.cli import main; "
                   "sys.exit(main(sys.argv[1:]))"]
        cmd = [*run, what,
               "--runtime-dir", str(self.tmp / "run"), "--state-dir", str(self.tmp / "state"),
               "--port", str(self.port), "--log-format", "json", *self.extra]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def _spawn(self, what: str, protocol_version: int | None) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{what}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)
        return subprocess.Popen(self._cmd(what, protocol_version), stdout=log,
                                stderr=subprocess.STDOUT, env=env)

    def start_daemon(self, protocol_version: int | None = None) -> None:
        self.daemon = self._spawn("daemon", protocol_version)

    def start_proxy(self, protocol_version: int | None = None) -> None:
        self.proxy = self._spawn("proxy", protocol_version)

    def log(self, what: str) -> str:
        """Everything `what` (daemon or proxy, every run of it) has logged so far."""
        path = self.tmp / f"{what}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, which: str) -> None:
        proc: subprocess.Popen[bytes] | None = getattr(self, which)
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in (self.proxy, self.daemon):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.proxy, self.daemon):
            if proc is None:
                continue
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n" + p.read_text(errors="replace")[-4000:]
            for p in sorted(self.tmp.glob("*.log")))

    # --- HTTP helpers ---------------------------------------------------------------------------

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def health(self) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code
        except httpx.HTTPError:
            return 0

    def wait_health(self, status: int = 200, timeout: float = READY_TIMEOUT_S) -> None:
        wait_for(lambda: self.health() == status, timeout, lambda: f"/health {status}\n{self.logs()}")

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return parse_metrics(r.text)


BASELINE_GAUGES = ("tether_requests_running", "tether_requests_waiting",
                   "tether_kv_cache_blocks_used", "tether_conversation_placeholders")


def assert_baseline(metrics: dict[str, float]) -> None:
    state = {g: m(metrics, g) for g in BASELINE_GAUGES}
    assert all(v == 0 for v in state.values()), state


def wait_aborts(server: Server, cause: str, count: float, timeout: float = 30.0) -> dict[str, float]:
    """Waits until the daemon has counted `count` aborts of `cause`; returns that scrape.

    The daemon evicts at the start of a tick and sends its Stats at the end of the same tick, so the
    first scrape that shows the abort also shows the state after it: asserting the gauges on that
    scrape asserts "back to baseline within one tick".
    """
    seen: dict[str, float] = {}

    def done() -> bool:
        nonlocal seen
        seen = server.metrics()
        return m(seen, "tether_aborts_total", cause=cause) >= count

    wait_for(done, timeout, lambda: f"{count} aborts with cause {cause}\n{server.logs()}")
    return seen


def start_server(tmp: Path, extra: list[str] | None = None,
                 api_key: str | None = None) -> Server:
    server = Server(tmp, free_port(), extra or [], api_key)
    server.start_daemon()
    server.start_proxy()
    try:
        server.wait_health(200)
    except AssertionError:
        server.stop()
        raise
    return server


# --- what the abort tests share -----------------------------------------------------------------

LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "tell me everything"}], **LONG}


def post_raw(server: Server, path: str, body: dict[str, Any],
             rid: str | None = None) -> socket.socket:
    """The request sent (with `rid` as its X-Request-Id), the socket left unread."""
    return raw_http.post_raw(server.port, path, body, rid, key=server.api_key)


def drop(sock: socket.socket) -> None:
    sock.close()


def wait_running(server: Server, at_least: int = 1, gauge: str = "tether_requests_running") -> None:
    wait_for(lambda: m(server.metrics(), gauge) >= at_least, 60, f"{gauge} >= {at_least}")


def check_abort(server: Server, before: dict[str, float], cause: str, sequences: int,
                aborts: int = 1) -> dict[str, float]:
    after = wait_aborts(server, cause, m(before, "tether_aborts_total", cause=cause) + aborts)
    assert_baseline(after)
    assert m(after, "tether_aborts_total", cause=cause) == m(
        before, "tether_aborts_total", cause=cause) + aborts
    wasted = (m(after, "tether_tokens_after_disconnect_total")
              - m(before, "tether_tokens_after_disconnect_total"))
    assert wasted <= sequences, f"{wasted} tokens generated after the disconnect"
    finished = m(after, "tether_requests_finished_total", reason="abort") - m(
        before, "tether_requests_finished_total", reason="abort")
    assert finished == aborts
    # The tick that applies an abort is the first to start after the record was written: at most
    # one tick can slip in between the proxy stamping the disconnect and writing the record.
    observed = m(after, "tether_abort_latency_ticks_count") - m(
        before, "tether_abort_latency_ticks_count")
    within_one = m(after, "tether_abort_latency_ticks_bucket", le="1.0") - m(
        before, "tether_abort_latency_ticks_bucket", le="1.0")
    assert observed == aborts and within_one == aborts
    return after
