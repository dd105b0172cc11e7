"""A request's tools cost the proxy's loop a bounded time (issue 34, item 11): a body of 80,000
tools under the body size limit, on chat and as one namespace on Responses, is a 400 naming the
limit within moments, while a bystander stream's events keep coming (before, a quadratic check
of the names held the loop for minutes, and the launcher's watchdog killed the proxy)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.openai.tool_requests import MAX_TOOLS
from tests.support.pair import Server, start_server, wait_running
from tests.support.streams import Bystanders

pytestmark = pytest.mark.timeout(300)

NUM_TOOLS = 80_000
BODY_LIMIT = 4 * 1024 * 1024  # the default --max-body-bytes
BYSTANDER = {"prompt": "a bystander", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
             "stream": True}  # ~6 s on sim:20: it outlasts both requests
# The loop's longest stall a stream may see; before the bound it was minutes.
MAX_GAP_S = 1.0
# The 400 itself (4 MB up, decoded, counted): well under a second here; generous for a busy host.
MAX_ANSWER_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("tool-bounds"), ["--model", "sim:20"])
    yield s
    s.stop()


def _functions(shape: str) -> list[dict[str, Any]]:
    if shape == "chat":
        return [{"type": "function", "function": {"name": f"f{i:05d}"}} for i in range(NUM_TOOLS)]
    return [{"type": "function", "name": f"f{i:05d}"} for i in range(NUM_TOOLS)]


BODIES = {
    "/v1/chat/completions": lambda: {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "tools": _functions("chat")},
    "/v1/responses": lambda: {
        "input": "hi", "max_output_tokens": 1,
        "tools": [{"type": "namespace", "name": "many", "description": "d",
                   "tools": _functions("responses")}]},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_of_80000_tools_is_a_fast_400_and_stalls_no_stream(server: Server,
                                                                   path: str) -> None:
    body = orjson.dumps(BODIES[path]())
    assert len(body) < BODY_LIMIT  # within every other limit: only the tools' is over
    assert server.proxy is not None
    pid = server.proxy.pid
    bystander = Bystanders(server.url, 1, body=BYSTANDER).start()
    wait_running(server)
    t0 = time.monotonic()
    r = httpx.post(server.url + path, content=body, timeout=120,
                   headers={"Content-Type": "application/json"})
    took = time.monotonic() - t0
    [stream] = bystander.join()
    assert stream.ok and stream.max_gap_s < MAX_GAP_S, (stream, took)
    assert took < MAX_ANSWER_S and r.status_code == 400, (took, r.text[:300])
    error = r.json()["error"]
    assert error["param"] == "tools" and str(MAX_TOOLS) in error["message"], error
    assert str(NUM_TOOLS) in error["message"]
    assert server.proxy.poll() is None and server.proxy.pid == pid
    assert server.health() == 200
