"""Misbehaving clients for the soak, each in a thread of its own beside the locust load:

- a client that never reads: a streaming completion (n=8, 20 logprobs) from a socket with a
  4 KB receive window, opened every --never-read-every seconds and held --never-read-hold
  seconds (past the proxy's stall timeout, by default) before it closes;
- a client that leaves during a 3 MB upload, every --upload-every seconds: the whole body is
  sent, then the socket closes while the proxy writes the request into the pipe;
- a ~2,000-token prefill, every --prefill-every seconds, whose answer must be a 200.

They stop (closing every socket they hold) before the load does, so locust's own end checks
(gauges back to their baseline) see a quiet server.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

UPLOAD_BYTES = 3_000_000
PREFILL_PROMPT = "tick " * 399  # ~2,000 tokens with the built-in byte tokenizer


def _request(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: tether\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


@dataclass
class FaultClients:
    base_url: str
    upload_every: float = 4.0
    never_read_every: float = 20.0
    never_read_hold: float = 75.0
    prefill_every: float = 30.0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    _held: collections.deque[tuple[float, socket.socket]] = field(
        default_factory=collections.deque)  # never-reading sockets, oldest first
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    @property
    def _address(self) -> tuple[str, int]:
        url = urlsplit(self.base_url)
        return url.hostname or "127.0.0.1", url.port or 80

    def start(self) -> FaultClients:
        for name, every, step in (("upload", self.upload_every, self._upload),
                                  ("never_read", self.never_read_every, self._never_read),
                                  ("prefill", self.prefill_every, self._prefill)):
            thread = threading.Thread(target=self._every, args=(every, step), daemon=True,
                                      name=f"fault-{name}")
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> dict[str, int]:
        """Stops every client and closes the sockets still held; returns the counts."""
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        while self._held:
            self._held.popleft()[1].close()
        return dict(self.counts)

    def _every(self, period: float, step: Callable[[], None]) -> None:
        while not self._stop.wait(period):
            try:
                step()
            except OSError as exc:
                self.counts[f"{step.__name__.strip('_')}_client_errors"] += 1
                print(f"fault client {step.__name__}: {exc}", flush=True)

    def _upload(self) -> None:
        body = {"prompt": "x" * UPLOAD_BYTES, "max_tokens": 1}
        with socket.create_connection(self._address, timeout=30) as sock:
            sock.sendall(_request("/v1/completions", body))
        self.counts["uploads_cancelled"] += 1

    def _never_read(self) -> None:
        now = time.monotonic()
        while self._held and now - self._held[0][0] >= self.never_read_hold:
            self._held.popleft()[1].close()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(self._address)
        sock.sendall(_request("/v1/completions", {
            "prompt": "never read", "n": 8, "logprobs": 20, "max_tokens": 1500,
            "ignore_eos": True, "stream": True}))
        self._held.append((now, sock))
        self.counts["never_readers"] += 1

    def _prefill(self) -> None:
        data = json.dumps({"prompt": PREFILL_PROMPT, "max_tokens": 4,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(self.base_url + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status = r.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        self.counts["prefills"] += 1
        if status >= 500:
            self.counts["prefill_5xx"] += 1
