"""The proxy on uvicorn on a real port, run in a thread of the test process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from proxy.server import ProxyServer, build_server
from tether.settings import Settings


@dataclass
class LiveProxy:
    server: ProxyServer
    thread: threading.Thread
    notes: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def port(self) -> int:
        port = self.server.port
        assert port is not None
        return port


def start_live(settings: Settings) -> LiveProxy:
    notes: list[str] = []
    server = build_server(settings, notes.append)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while "READY=1" not in notes:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.01)
    return LiveProxy(server, thread, notes)


def stop_live(live: LiveProxy) -> None:
    live.server.should_exit = True
    live.thread.join(15)
    assert not live.thread.is_alive()
