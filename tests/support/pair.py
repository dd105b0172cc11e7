"""The real daemon and proxy processes on real FIFOs and a real port, and the checks that every
abort test makes on them.

Both processes log JSON lines; the daemon's per-request lines (logger ``tether.requests``) carry
monotonic stamps (CLOCK_MONOTONIC is one clock for every process on the machine), so a test
can measure from the moment its own client closed the socket, not from the proxy's stamp.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from daemon.engine.figures import LOGGED_TICKS
from ipc.framing import daemon_decoder, proxy_decoder
from ipc.pipes import TOKENS
from ipc.wire import Record
from tests.support import raw_http
from tests.support.metrics import m, parse_metrics
from tests.support.systemd import TEST_MODEL
from tests.support.wait import free_port, wait_for

READY_TIMEOUT_S = 120.0


@dataclass
class Server:
    tmp: Path
    port: int
    extra: list[str] = field(default_factory=list)
    api_key: str | None = None
    # Run in each child before it starts (resource limits); added to each child's environment.
    preexec: Callable[[], None] | None = None
    environ: dict[str, str] = field(default_factory=dict)
    # The model unless `extra` names one; None: no --model at all (the server's default).
    model: str | None = TEST_MODEL
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
               "--port", str(self.port), "--log-format", "json",
               *(["--model", self.model] if self.model else []), *self.extra]  # extra's wins
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def _spawn(self, what: str, protocol_version: int | None) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{what}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)
        if self.model is None:
            env.pop("TETHER_MODEL", None)
        env.update(self.environ)
        return subprocess.Popen(self._cmd(what, protocol_version), stdout=log,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=self.preexec)

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

    def log_lines(self, which: str) -> list[dict[str, Any]]:
        """The JSON lines `which` ("daemon" or "proxy") has logged, over all its runs."""
        text = (self.tmp / f"{which}.log").read_text(errors="replace")
        return [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]

    def request_line(self, rid: str, timeout: float = 30.0) -> dict[str, Any]:
        """The daemon's log line for the end of request `rid`: the X-Request-Id it was sent with
        (logged as `client_id`) or the engine's key (waits for it)."""
        found: list[dict[str, Any]] = []

        def logged() -> bool:
            if f'"{rid}"' not in (self.tmp / "daemon.log").read_text(errors="replace"):
                return False  # cheap: this polls while the pair is under test
            found[:] = [x for x in self.log_lines("daemon") if x["logger"] == "tether.requests"
                        and rid in (x.get("rid"), x.get("client_id"))]
            return bool(found)

        wait_for(logged, timeout, lambda: f"the daemon's log line for {rid}\n{self.logs()}")
        assert len(found) == 1, found
        return found[0]

    def signal(self, which: str, signum: signal.Signals) -> float:
        """Sends `signum` to the daemon or the proxy; returns the monotonic time just before."""
        proc: subprocess.Popen[bytes] | None = getattr(self, which)
        assert proc is not None
        t = time.monotonic()
        proc.send_signal(signum)
        return t

    def take_frames(self, pipe: str) -> list[Record]:
        """Every whole record waiting in `pipe`, read from a second read end. Only while the
        pipe's own reader is stopped: what this takes, that reader never gets."""
        fd = os.open(self.tmp / "run" / pipe, os.O_RDONLY | os.O_NONBLOCK)
        decoder = proxy_decoder() if pipe == TOKENS else daemon_decoder(pipe)
        records: list[Record] = []
        try:
            while True:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    break
                if not data:
                    break
                records += decoder.feed(data)
        finally:
            os.close(fd)
        return records

    # --- HTTP helpers ---------------------------------------------------------------------------

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def health(self) -> int:
        try:
            return httpx.get(self.url + "/health", headers=self.headers, timeout=2.0).status_code
        except httpx.HTTPError:
            return 0

    def wait_health(self, status: int = 200, timeout: float = READY_TIMEOUT_S) -> None:
        wait_for(lambda: self.health() == status, timeout, lambda: f"/health {status}\n{self.logs()}")

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return parse_metrics(r.text)

    def barrier(self) -> None:
        """A round trip on the control pipe: the daemon answers a ResponseOp only after reading
        every control record written before it (Aborts included)."""
        with self.client() as c:
            r = c.get(f"/v1/responses/resp_barrier_{uuid.uuid4().hex}")
        assert r.status_code == 404, r.text


BASELINE_GAUGES = ("tether_requests_running", "tether_requests_waiting",
                   "tether_kv_cache_blocks_used", "tether_conversation_placeholders",
                   "tether_grammar_compiles_pending")


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


def start_server(tmp: Path, extra: list[str] | None = None, api_key: str | None = None,
                 preexec: Callable[[], None] | None = None,
                 environ: dict[str, str] | None = None,
                 model: str | None = TEST_MODEL) -> Server:
    server = Server(tmp, free_port(), extra or [], api_key, preexec, environ or {}, model)
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
# builtin:small ticks take ~50 ms here, far longer than the proxy takes to see a closed socket
# (measured: under 20 ms on this busy 2-core machine). builtin:tiny's 2.4 ms ticks are shorter
# than that on a busy machine, and a second tick slips in after ~2% of closes.
ABORT_MODEL = ["--model", "builtin:small", "--kv-cache-blocks", "512"]
# Close -> eviction is about one tick (~50 ms); this only catches a proxy or daemon that is
# seconds late. The exact bound is the tick count asserted with it.
CLOSE_TO_EVICTION_S = 1.0


def new_rid(prefix: str) -> str:
    """A request id no other request of the session has (the daemon's log lines key on it)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def post_raw(server: Server, path: str, body: dict[str, Any],
             rid: str | None = None, headers: dict[str, str] | None = None) -> socket.socket:
    """The request sent (with `rid` as its X-Request-Id), the socket left unread."""
    return raw_http.post_raw(server.port, path, body, rid, key=server.api_key, headers=headers)


def drop(sock: socket.socket) -> float:
    """Closes the client's socket; returns the monotonic time just before."""
    t_close = time.monotonic()
    sock.close()
    return t_close


def wait_running(server: Server, at_least: int = 1, gauge: str = "tether_requests_running") -> None:
    wait_for(lambda: m(server.metrics(), gauge) >= at_least, 60, f"{gauge} >= {at_least}")


def check_abort(server: Server, before: dict[str, float], rid: str, t_close: float,
                sequences: int, cause: str = "client_disconnect",
                tokens_per_pass: int = 1) -> dict[str, float]:
    """One request `rid` whose client closed at `t_close` was aborted: the daemon's figures
    (Stats, through /metrics) and its per-request log line, on the client's clock."""
    line = server.request_line(rid)
    after = check_abort_figures(server, before, cause)
    check_eviction(line, t_close, sequences, cause, tokens_per_pass)
    return after


def drop_mid_stream(server: Server, path: str, body: dict[str, Any], prefix: str,
                    events: int = 5, tokens_per_pass: int = 1) -> str:
    """A streamed request dropped after `events` events, checked by `check_abort`; its rid."""
    before = server.metrics()
    rid = new_rid(prefix)
    sock = post_raw(server, path, body, rid)
    raw_http.read_events(sock, events)
    check_abort(server, before, rid, drop(sock), sequences=1, tokens_per_pass=tokens_per_pass)
    return rid


def check_abort_figures(server: Server, before: dict[str, float],
                        cause: str = "client_disconnect") -> dict[str, float]:
    """One more abort of `cause`, as the daemon's Stats (through /metrics) show it."""
    after = wait_aborts(server, cause, m(before, "tether_aborts_total", cause=cause) + 1)
    # Back to baseline in the Stats of the very tick that applied the abort.
    assert_baseline(after)
    assert m(after, "tether_aborts_total", cause=cause) == m(
        before, "tether_aborts_total", cause=cause) + 1
    finished = m(after, "tether_requests_finished_total", reason="abort") - m(
        before, "tether_requests_finished_total", reason="abort")
    assert finished == 1
    # The daemon reads control at the start of each tick: at most one tick starts between the
    # proxy stamping the disconnect and the eviction (one being scheduled as the record came).
    observed = m(after, "tether_abort_latency_ticks_count") - m(
        before, "tether_abort_latency_ticks_count")
    within_one = m(after, "tether_abort_latency_ticks_bucket", le="1.0") - m(
        before, "tether_abort_latency_ticks_bucket", le="1.0")
    assert observed == 1 and within_one == 1
    return after


def check_eviction(line: dict[str, Any], t_close: float, sequences: int,
                   cause: str = "client_disconnect", tokens_per_pass: int = 1) -> None:
    """Per request, from the client's close: at most one of the session's forward passes (one
    token per sequence, or 1 + k drafted ones with speculation) started after it, none after
    the daemon read the abort, and the session was evicted within CLOSE_TO_EVICTION_S."""
    assert line["finish_reason"] == "abort" and line["cause"] == cause, line
    ticks: list[tuple[float, int]] = line["last_ticks"]
    assert len(ticks) < LOGGED_TICKS or ticks[0][0] <= t_close, (
        f"all {LOGGED_TICKS} logged ticks started after the client's close: {line}")
    after_close = [(t, n) for t, n in ticks if t > t_close]
    assert len(after_close) <= 1, f"{len(after_close)} ticks after the close: {line}"
    assert sum(n for _, n in after_close) <= sequences * tokens_per_pass, line
    assert 0 < line["evicted_at"] - t_close < CLOSE_TO_EVICTION_S, (t_close, line)
    # The proxy stamps the disconnect after the close (one clock); no forward pass of this
    # session started after the tick in which the daemon read the abort had begun.
    t_seen = line["evicted_at"] - line["abort_latency_s"]
    assert t_close <= t_seen + 1e-5, (t_close, line)
    t_read = t_seen + line["abort_read_s"]
    assert all(t < t_read + 1e-5 for t, _ in ticks), (t_read, line)
