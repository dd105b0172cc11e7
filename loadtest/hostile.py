"""Hostile clients for the soak (issue 21's ways through), each a thread beside the locust load.
None of them may cost a well-behaved client its work: the soak judges that by 5xx, proxy_lost
and TTFT.

- big replies: a stored response holding the largest input items and metadata the edge allows,
  listed and fetched by several concurrent `GET` loops;
- nested bodies: every --nested-every seconds, four 3.9 MB Responses bodies of 1.3 million
  empty lists, completed at the same instant (each must be a 400);
- idle sockets: --idle-sockets connections that never send a byte, reopened as the proxy's
  head timeout closes them;
- trickling heads: --trickle-sockets connections sending a request head one byte a second;
- huge heads: every --huge-every seconds, connections sending 8 MB of a head that never ends
  (each must be answered 431 or closed);
- one enormous request: every --big-every seconds, 128 prompts x n=2 (the per-request cap)
  that does not stream.

`stop` returns what each met; any 5xx is counted under "5xx".
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

NESTED_BODY = (b'{"input": [{"type": "message", "role": "user", "content": "x", "junk": ['
               + b",".join([b"[]"] * 1_300_000) + b"]}]}")
HUGE_HEAD_BYTES = 8 << 20


@dataclass
class HostileClients:
    base_url: str
    reply_readers: int = 4
    nested_every: float = 15.0
    idle_sockets: int = 400
    trickle_sockets: int = 20
    huge_every: float = 20.0
    big_every: float = 30.0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    _idle: list[socket.socket] = field(default_factory=list)
    _trickling: list[socket.socket] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def _address(self) -> tuple[str, int]:
        url = urlsplit(self.base_url)
        return url.hostname or "127.0.0.1", url.port or 80

    def start(self) -> HostileClients:
        stored = self._store_big_response()
        jobs: list[tuple[str, Callable[[], None], float]] = [
            (f"replies-{i}", lambda: self._read_replies(stored), 0.05)
            for i in range(self.reply_readers)]
        jobs += [("nested", self._nested, self.nested_every),
                 ("idle", lambda: self._hold("idle", self.idle_sockets, self._idle, None), 1.0),
                 ("trickle", lambda: self._hold("trickle", self.trickle_sockets,
                                                self._trickling, b"X"), 1.0),
                 ("huge", self._huge, self.huge_every), ("big", self._big, self.big_every)]
        for name, step, every in jobs:
            thread = threading.Thread(target=self._every, args=(every, step), daemon=True,
                                      name=f"hostile-{name}")
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> dict[str, int]:
        """Stops every client and closes what it holds; returns the counts."""
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        for sock in [*self._idle, *self._trickling]:
            sock.close()
        return dict(self.counts)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _every(self, period: float, step: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                step()
            except OSError as exc:
                self._count("client_errors")
                print(f"hostile client: {exc}", flush=True)
            if self._stop.wait(period):
                return

    def _status(self, req: urllib.request.Request | str, timeout: float) -> int:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                r.read()
                status = int(r.status)
        except urllib.error.HTTPError as exc:
            status = exc.code
        if status >= 500:
            self._count("5xx")
        return status

    def _post(self, path: str, body: object, timeout: float = 300.0) -> int:
        return self._status(urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}), timeout)

    # --- the clients ----------------------------------------------------------------------------

    def _store_big_response(self) -> str:
        items = [{"type": "message", "role": "user", "id": f"{'i' * 62}{i:02d}",
                  "content": [{"type": "input_text", "text": "x"}]} for i in range(64)]
        metadata = {f"{k:02d}{'k' * 62}": "v" * 512 for k in range(16)}
        req = urllib.request.Request(
            self.base_url + "/v1/responses", headers={"Content-Type": "application/json"},
            data=json.dumps({"input": items, "metadata": metadata,
                             "max_output_tokens": 4}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            return str(json.loads(r.read())["id"])

    def _read_replies(self, response_id: str) -> None:
        for path in (f"/v1/responses/{response_id}/input_items?limit=100",
                     f"/v1/responses/{response_id}"):
            self._count(f"reply_{self._status(self.base_url + path, 60)}")

    def _nested(self) -> None:
        head = (f"POST /v1/responses HTTP/1.1\r\nHost: tether\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(NESTED_BODY)}\r\n\r\n").encode()
        socks = []
        for _ in range(4):  # all but the last byte of each, then the four last bytes at once
            sock = socket.create_connection(self._address, timeout=60)
            sock.sendall(head + NESTED_BODY[:-1])
            socks.append(sock)
        for sock in socks:
            sock.sendall(NESTED_BODY[-1:])
        for sock in socks:
            with sock:
                self._count(f"nested_{_status_of(sock.recv(64))}")

    def _hold(self, what: str, want: int, held: list[socket.socket], each: bytes | None) -> None:
        """Keeps `want` sockets of a kind open, reopening those the proxy closed, and sends
        each a byte of `each` if given."""
        alive = []
        for sock in held:
            try:
                if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    sock.close()
                    self._count(f"{what}_closed_by_proxy")
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            alive.append(sock)
        held[:] = alive
        while len(held) < want:
            sock = socket.create_connection(self._address, timeout=10)
            if each is not None:
                sock.sendall(b"G")  # a head begun, then a byte a second
            held.append(sock)
            self._count(f"{what}_opened")
        if each is not None:
            for sock in held:
                try:
                    sock.send(each)
                except OSError:
                    pass

    def _huge(self) -> None:
        for _ in range(4):
            with socket.create_connection(self._address, timeout=30) as sock:
                answer = b""
                try:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: tether\r\nX-Junk: ")
                    sent = 0
                    while sent < HUGE_HEAD_BYTES:
                        sent += sock.send(b"a" * 65536)
                    answer = sock.recv(64)
                except OSError:  # the proxy answered and stopped reading while we still wrote
                    with contextlib.suppress(OSError):
                        answer = sock.recv(64)
                self._count(f"huge_{_status_of(answer)}")

    def _big(self) -> None:
        body = {"prompt": [f"p{i}" for i in range(128)], "n": 2, "max_tokens": 64}
        self._count(f"big_{self._post('/v1/completions', body)}")


def _status_of(answer: bytes) -> str:
    """The status code of an HTTP answer's first bytes, or "closed"."""
    parts = answer.split(b" ")
    return parts[1].decode() if len(parts) > 1 and answer.startswith(b"HTTP/") else "closed"
