"""A loopback HTTP server between a real client (Codex, Claude Code) and the pair: it passes each
POST on and records it, rewriting its body first where a test asks (to force a tool call), and
the pair's answer comes back as it is written."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

# (index of the request, its body): rewrites the body in place before it is passed on.
Rewrite = Callable[[int, dict[str, Any]], None]


class _Handler(http.server.BaseHTTPRequestHandler):
    upstream = ""
    passed: tuple[str, ...] = ()
    rewrite: Rewrite | None = None
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "headers": dict(self.headers),
                          "body": json.loads(json.dumps(body))})
        if self.rewrite is not None:
            self.rewrite(len(self.seen) - 1, body)
        headers = {k: v for k, v in self.headers.items() if k.lower() in self.passed}
        with httpx.stream("POST", self.upstream + self.path, json=body, headers=headers,
                          timeout=300) as r:
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers["content-type"])
            self.end_headers()
            for chunk in r.iter_raw():
                self.wfile.write(chunk)
                self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def shim(upstream: str, passed: tuple[str, ...],
         rewrite: Rewrite | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The shim's URL and the requests it has seen (path, headers, body as the client sent it);
    `passed` names the headers it passes on."""
    seen: list[dict[str, Any]] = []
    handler = type("Shim", (_Handler,), {"upstream": upstream, "passed": passed,
                                         "rewrite": rewrite and staticmethod(rewrite),
                                         "seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
