"""End-to-end harness: the real daemon and proxy processes on real FIFOs and a real port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

READY_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value, labels kept verbatim as Prometheus prints them."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


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

    def _cmd(self, what: str) -> list[str]:
        cmd = [sys.executable, "-m", "tether.cli", what,
               "--runtime-dir", str(self.tmp / "run"), "--state-dir", str(self.tmp / "state"),
               "--port", str(self.port), "--log-format", "text", *self.extra]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def _spawn(self, what: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{what}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)
        return subprocess.Popen(self._cmd(what), stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_daemon(self) -> None:
        self.daemon = self._spawn("daemon")

    def start_proxy(self) -> None:
        self.proxy = self._spawn("proxy")

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
        wait_for(lambda: self.health() == status, timeout, f"/health {status}\n{self.logs()}")

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return parse_metrics(r.text)


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def m(metrics: dict[str, float], name: str, **labels: str) -> float:
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return metrics.get(key, 0.0)


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

    wait_for(done, timeout, f"{count} aborts with cause {cause}\n{server.logs()}")
    return seen


def sse_json(line: str) -> dict[str, object] | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return orjson.loads(line[6:])  # type: ignore[no-any-return]


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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e"), ["--max-num-seqs", "8"])
    yield s
    s.stop()
