"""The proxy on uvicorn on a real port, run in a thread of the test process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

from proxy.options import ProxyOptions
from proxy.server import ProxyServer, build_server
from tests.support.wait import wait_for


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


def start_live(options: ProxyOptions) -> LiveProxy:
    notes: list[str] = []
    server = build_server(options, notes.append)
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


def settle(live: LiveProxy, api_key: str | None = None) -> None:
    """A barrier: every request handler has returned, and the daemon side has read every control
    record they wrote (it answers a ResponseOp only after the records before it)."""
    wait_for(lambda: not live.server.server_state.tasks, 10, "the proxy's handlers to return")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(live.url + "/v1/responses/resp_barrier", headers=headers, timeout=10)
    assert r.status_code == 404, r.text
