"""With an API key: what it guards (the API; every route with --api-key-scope all), and the
pure-ASGI auth middleware keeps receive() intact: drops still abort."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.pair import (
    ABORT_MODEL,
    CHAT,
    LONG,
    Server,
    check_abort,
    drop,
    new_rid,
    post_raw,
    start_server,
    wait_running,
)
from tests.support.raw_http import read_events, response_id_from_stream

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("auth"), ABORT_MODEL, api_key="sk-test-key")
    yield s
    s.stop()


def test_wrong_key_is_401(auth_server: Server) -> None:
    r = httpx.post(auth_server.url + "/v1/completions", json={"prompt": "x"},
                   headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.json()["error"]["message"]
    assert httpx.get(auth_server.url + "/health").status_code == 200


OPEN_BY_DEFAULT = ("/health", "/metrics", "/openapi.json")


def test_by_default_probes_scrapers_and_the_document_need_no_key(auth_server: Server) -> None:
    for path in OPEN_BY_DEFAULT:
        assert httpx.get(auth_server.url + path, timeout=10.0).status_code == 200, path
    assert httpx.get(auth_server.url + "/v1/models", timeout=10.0).status_code == 401


def test_scope_all_puts_every_route_behind_the_key(tmp_path: Path) -> None:
    # Through its TETHER_* variable, as a unit's environment file would set it.
    server = start_server(tmp_path, ["--model", "sim:5"], api_key="sk-all",
                          environ={"TETHER_API_KEY_SCOPE": "all"})
    try:
        for path in (*OPEN_BY_DEFAULT, "/v1/models", "/nowhere"):
            refused = httpx.get(server.url + path, timeout=10.0)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
            allowed = httpx.get(server.url + path, headers=server.headers, timeout=10.0)
            assert allowed.status_code == (404 if path == "/nowhere" else 200), path
    finally:
        server.stop()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "stream": True, **LONG}),
    ("/v1/responses", {"input": "hi", "stream": True, "max_output_tokens": 1500,
                       "ignore_eos": True}),
])
def test_streaming_drop_aborts_with_auth(auth_server: Server, path: str,
                                         body: dict[str, Any]) -> None:
    before = auth_server.metrics()
    rid = new_rid("auth")
    sock = post_raw(auth_server, path, body, rid)
    raw = read_events(sock, 8)
    sequences = 4 if path == "/v1/completions" else 1
    check_abort(auth_server, before, rid, drop(sock), sequences=sequences)
    if path == "/v1/responses":
        with auth_server.client() as c:
            assert c.get(f"/v1/responses/{response_id_from_stream(raw)}").status_code == 404


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1500, "ignore_eos": True}),
])
def test_non_streaming_drop_aborts_with_auth(auth_server: Server, path: str,
                                             body: dict[str, Any]) -> None:
    before = auth_server.metrics()
    rid = new_rid("auth")
    sock = post_raw(auth_server, path, body, rid)
    wait_running(auth_server)
    check_abort(auth_server, before, rid, drop(sock), sequences=1)
