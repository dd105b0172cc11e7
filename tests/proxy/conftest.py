"""Fixtures of the proxy tests: the scripted daemon (tests/support/peer.py) on real FIFOs, and
the proxy app driven in-process or on a real port (tests/support/live_proxy.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from proxy.app import create_app
from proxy.options import ProxyOptions
from tests.support.live_proxy import LiveProxy, start_live, stop_live
from tests.support.options import proxy_options
from tests.support.peer import MODEL, Peer
from tests.support.wait import wait_for, wait_until


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def options(tmp_path: Path) -> ProxyOptions:
    return proxy_options(runtime_dir=tmp_path / "run", port=0, model=MODEL)


@pytest.fixture
def peer(options: ProxyOptions) -> Iterator[Peer]:
    p = Peer(options.runtime_dir).start()
    yield p
    p.stop()


@contextlib.asynccontextmanager
async def running_app(options: ProxyOptions) -> AsyncIterator[Starlette]:
    """The app in-process (lifespan run by hand), connected to the test daemon."""
    app = create_app(options)
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.engine.up)
        yield app


@pytest.fixture
async def client(options: ProxyOptions, peer: Peer) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(options) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            yield c


@pytest.fixture
def live(options: ProxyOptions, peer: Peer) -> Iterator[LiveProxy]:
    """The proxy on uvicorn on a real port, in a thread, connected to the test daemon."""
    proxy = start_live(options)
    wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 10,
             "the proxy to reach the test daemon")
    yield proxy
    stop_live(proxy)
