"""Runs the proxy app on uvicorn: readiness and watchdog notifications, graceful SIGTERM.

On SIGTERM the listener closes first, open sessions get `drain_timeout_s` to finish, then the
rest are aborted with cause ``shutdown`` (their clients get a 503 or a final error event) before
uvicorn closes the connections. Background responses are not waited for nor aborted: the daemon
goes on with them and the next proxy serves them from the store; their readers here get an
error event that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from ipc.records import AbortCause
from proxy.app import create_app
from proxy.engine.client import EngineClient
from proxy.http.protocol import protocol_class
from proxy.options import ProxyOptions
from proxy.responses.routes import release_background

log = logging.getLogger("tether.proxy")

Notify = Callable[[str], object]

WATCHDOG_INTERVAL_S = 2.0
# Until the daemon has connected, each ping also pushes the supervisor's start timeout this far
# out (EXTEND_TIMEOUT_USEC): the proxy is alive and waiting, however long the daemon loads.
START_EXTEND_S = 30.0
# Once open sessions were aborted, their responses end within a moment.
CLOSE_TIMEOUT_S = 2.0
# Each client socket's kernel send buffer. Left to autotuning it grows to tcp_wmem's maximum
# (4 MiB) for a client that does not read, and all of it is tokens generated for nobody before
# flow control (which sees only what the proxy holds) can pause the stream. 256 KiB (the kernel
# doubles it) is still far more than a stream needs in flight.
SEND_BUFFER_BYTES = 256 * 1024


class ProxyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette, drain_timeout_s: float,
                 notify: Notify | None = None) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self.notify: Notify = notify or (lambda message: None)
        self._watchdog: asyncio.Task[None] | None = None
        self._readiness: asyncio.Task[None] | None = None
        self.ready = False

    @property
    def port(self) -> int | None:
        for server in getattr(self, "servers", []):
            for sock in server.sockets or ():
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    return int(sock.getsockname()[1])
        return None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The first SIGTERM/SIGINT asks, a second forces. Not re-raised after the shutdown (as
        # uvicorn does): a drained exit is a clean exit, status 0.
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        for server in self.servers:
            for sock in server.sockets or ():
                # Accepted connections inherit the listening socket's buffer size.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._watchdog = asyncio.create_task(self._pet_watchdog(), name="tether-watchdog")
        self._readiness = asyncio.create_task(self._ready_once_connected(),
                                              name="tether-readiness")

    async def _ready_once_connected(self) -> None:
        """READY=1 once the daemon has connected, not when the port is bound: ready means a
        request sent now is served. Until then the proxy answers 503 and says why."""
        where = f"listening on {self.config.host}:{self.port}"
        self.notify(f"STATUS={where}, waiting for the daemon")
        engine: EngineClient = self.app.state.engine
        await engine.wait_up()
        self.ready = True
        self.notify(f"STATUS={where}")
        self.notify("READY=1")

    async def _pet_watchdog(self) -> None:
        # From the event loop, so a blocked loop stops the pings and systemd notices. They start
        # before READY=1 and never pause: the first ping arms systemd's watchdog, ready or not.
        extend = f"\nEXTEND_TIMEOUT_USEC={int(START_EXTEND_S * 1_000_000)}"
        while True:
            self.notify("WATCHDOG=1" + ("" if self.ready else extend))
            await asyncio.sleep(WATCHDOG_INTERVAL_S)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.notify("STOPPING=1")
        for server in self.servers:
            server.close()
        engine: EngineClient | None = getattr(self.app.state, "engine", None)
        if engine is not None:
            await self._drain(engine)
        for task in (self._readiness, self._watchdog):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await super().shutdown(sockets)

    async def _drain(self, engine: EngineClient) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        # Polling, not an event: a second signal (force_exit) must cut the wait short too.
        while engine.num_attached and time.monotonic() < deadline and not self.force_exit:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        release_background(self.app)
        aborted = engine.abort_all(AbortCause.SHUTDOWN)
        if aborted:
            log.info("shutdown: aborted %d session(s) still running after %.1f s", aborted,
                     self.drain_timeout_s)


def build_server(options: ProxyOptions, notify: Notify | None = None) -> ProxyServer:
    app = create_app(options)
    config = uvicorn.Config(
        app, host=options.host, port=options.port, loop="auto",
        # httptools, with the limits on connections, request heads and bodies it lacks.
        http=protocol_class(options),
        lifespan="on", log_config=None, access_log=False,
        # Nothing reads the client's address (no access log): rewriting it from X-Forwarded-*
        # headers would be a middleware layer on every request for nothing.
        proxy_headers=False,
        timeout_graceful_shutdown=int(CLOSE_TIMEOUT_S),
        # A client that sends on an idle connection just as the server closes it loses that
        # request. Clients keep idle connections a few seconds (httpx: 5, uvicorn's own default),
        # load balancers about a minute: the server waits longer, and says how long.
        timeout_keep_alive=options.keep_alive_timeout_s,
        headers=[("keep-alive", f"timeout={options.keep_alive_timeout_s}")],
    )
    return ProxyServer(config, app, options.drain_timeout_s, notify)


def run(options: ProxyOptions, notify: Callable[[str], object] | None = None) -> int:
    server = build_server(options, notify)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind or start the app
        return exc.code if isinstance(exc.code, int) else 1
    return 0 if server.started else 1
