"""Background responses tell the truth about themselves, on the real pair: a daemon pause never
gives a reader an ending the store contradicts, a DELETE leaves nothing behind wherever the
response was, a stream asked to start past its end is refused, and what the proxy keeps of
their events, like what the store keeps of responses, is bounded in bytes."""

from __future__ import annotations

import re
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.support.faults import stopped
from tests.support.metrics import m
from tests.support.pair import Server, start_server
from tests.support.raw_http import collect_events, sse_events
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(180)

LONG = {"max_output_tokens": 1500, "ignore_eos": True, "temperature": 0}
PAUSE_S = 4.5  # the pause: past the proxy's 3 s silence bound
HISTORY_BYTES = 60_000
STORE_BYTES = 40_000


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """sim:10 (10 ms a token), two sequences at a time: a third request waits its turn."""
    s = start_server(tmp_path_factory.mktemp("background"),
                     ["--model", "sim:10", "--max-num-seqs", "2"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("bounded"), [
        "--model", "sim:2", "--background-history-bytes", str(HISTORY_BYTES),
        "--response-store-max-bytes", str(STORE_BYTES)])
    yield s
    s.stop()


def _text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] for part in item["content"])


def _wait_ended(server: Server, rid: str) -> dict[str, Any]:
    with server.client() as c:
        wait_for(lambda: c.get(f"/v1/responses/{rid}").json()["status"]
                 not in ("queued", "in_progress"), 60, f"{rid} ends")
        stored: dict[str, Any] = c.get(f"/v1/responses/{rid}").json()
    return stored


def test_a_daemon_pause_never_tells_a_reader_a_false_ending(pair: Server) -> None:
    """The proxy takes the paused daemon for lost; the daemon resumes and finishes the response.
    Its reader is told the stream was interrupted, then gets the ending the store holds."""
    events: list[dict[str, Any]] = []
    body = {"input": "keep going", "background": True, "stream": True,
            "max_output_tokens": 400, "ignore_eos": True, "temperature": 0}
    reader = threading.Thread(target=collect_events,
                              args=(pair.url, "POST", "/v1/responses", events, body))
    reader.start()
    wait_for(lambda: any(e["type"] == "response.output_text.delta" for e in events), 30,
             "the first tokens")
    rid = events[0]["response"]["id"]
    stopped_at = time.monotonic()
    with stopped(pair.daemon):
        wait_for(lambda: any(e["type"] == "error" for e in events), 10, "the reader is told")
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - stopped_at)))
    reader.join(60)
    assert not reader.is_alive()
    stored = _wait_ended(pair, rid)
    assert stored["status"] == "incomplete" and stored["usage"]["output_tokens"] == 400, stored

    types = [e["type"] for e in events]
    assert "response.failed" not in types, types[-5:]
    errors = [e for e in events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["stream_interrupted"], errors
    assert events[-1]["type"] == "response.incomplete", types[-5:]
    assert events[-1]["response"] == stored
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == _text(stored)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))

    # Later readers get the same events: from the start, and resumed after the interruption.
    at = errors[0]["sequence_number"]
    with pair.client() as c:
        assert sse_events(c.get(f"/v1/responses/{rid}?stream=true").content) == events
        resumed = c.get(f"/v1/responses/{rid}?stream=true&starting_after={at}")
    assert sse_events(resumed.content) == events[at + 1:]


def test_a_background_response_deleted_at_once_is_gone_wherever_it_was(pair: Server) -> None:
    """Created behind others (queued in the proxy, in the pipe or waiting in the daemon, as the
    timing falls) and deleted at once: 404 from then on, and it never runs."""
    with pair.client() as c:
        busy = [c.post("/v1/responses", json={"input": f"busy {i}", "background": True, **LONG})
                .json()["id"] for i in range(6)]
        wait_for(lambda: m(pair.metrics(), "tether_requests_running") == 2, 30, "two running")
        deleted = []
        for i in range(5):
            rid = c.post("/v1/responses", json={"input": f"never mind {i}", "background": True,
                                                **LONG}).json()["id"]
            r = c.delete(f"/v1/responses/{rid}")
            assert r.status_code == 200, r.text
            assert r.json() == {"id": rid, "object": "response.deleted", "deleted": True}
            deleted.append(rid)
        pair.barrier()
        for rid in deleted:
            for r in (c.get(f"/v1/responses/{rid}"), c.get(f"/v1/responses/{rid}/input_items"),
                      c.post(f"/v1/responses/{rid}/cancel"),
                      c.get(f"/v1/responses/{rid}?stream=true")):
                assert r.status_code == 404, (r.request.method, r.request.url, r.text)
            line = pair.request_line(rid)
            assert line["cause"] == "cancel" and line.get("generated_tokens", 0) == 0, line
        # A running one is cancelled, then deleted.
        running = busy[0]
        assert c.delete(f"/v1/responses/{running}").status_code == 200
        assert c.get(f"/v1/responses/{running}").status_code == 404
        assert pair.request_line(running)["cause"] == "cancel"
        for rid in busy[1:]:
            assert c.post(f"/v1/responses/{rid}/cancel").status_code == 200
        pair.barrier()
        assert all(c.get(f"/v1/responses/{rid}").status_code == 404 for rid in deleted)


def test_starting_after_past_the_end_is_refused_naming_it(pair: Server) -> None:
    with pair.client() as c:
        rid = c.post("/v1/responses", json={"input": "short", "background": True,
                                            "max_output_tokens": 4}).json()["id"]
        _wait_ended(pair, rid)
        events = sse_events(c.get(f"/v1/responses/{rid}?stream=true").content)
        last = events[-1]["sequence_number"]
        assert events[-1]["type"] == "response.incomplete"
        r = c.get(f"/v1/responses/{rid}?stream=true&starting_after={last + 1}")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "starting_after" and str(last) in error["message"], error
        # After the last event there is nothing more to send.
        done = c.get(f"/v1/responses/{rid}?stream=true&starting_after={last}")
        assert done.status_code == 200 and sse_events(done.content) == []


def _first_held(message: str) -> int:
    found = re.search(r"starting_after=(\d+)", message)
    assert found, message
    return int(found.group(1))


def test_background_event_history_is_bounded_by_bytes(bounded: Server) -> None:
    """A run's events past the bound are let go oldest first (a reader who asks for them is told
    where the held ones start); a finished run is let go whole when a newer one needs room,
    and its GET then answers from the store."""
    body = {"input": "a long one", "background": True, "max_output_tokens": 1000,
            "ignore_eos": True, "temperature": 0}
    with bounded.client() as c:
        first = c.post("/v1/responses", json=body).json()["id"]
        stored = _wait_ended(bounded, first)
        whole = c.get(f"/v1/responses/{first}?stream=true")
        assert whole.status_code == 400, whole.text[:300]
        error = whole.json()["error"]
        assert error["param"] == "starting_after", error
        start = _first_held(error["message"])
        held = sse_events(c.get(f"/v1/responses/{first}?stream=true&starting_after={start}")
                          .content)
        assert held[0]["sequence_number"] == start + 1
        assert held[-1]["type"] == "response.incomplete"
        assert sum(len(orjson.dumps(e)) for e in held[:-1]) <= HISTORY_BYTES
        deltas = "".join(e["delta"] for e in held if e["type"] == "response.output_text.delta")
        assert deltas and _text(stored).endswith(deltas)

        second = c.post("/v1/responses", json=body).json()["id"]
        _wait_ended(bounded, second)
        gone = c.get(f"/v1/responses/{first}?stream=true&starting_after={start}")
        assert gone.status_code == 400 and gone.json()["error"]["param"] == "stream", gone.text
        assert c.get(f"/v1/responses/{first}").json()["status"] == "incomplete"


def test_the_response_store_is_bounded_by_bytes(bounded: Server) -> None:
    """Finished responses over the byte bound are pruned, oldest first."""
    with bounded.client() as c:
        ids = [c.post("/v1/responses", json={"input": f"{i:04d}" + "x" * 2000,
                                             "max_output_tokens": 1}).json()["id"]
               for i in range(30)]
        wait_for(lambda: c.get(f"/v1/responses/{ids[0]}").status_code == 404, 30,
                 "the oldest responses pruned")
        kept = [c.get(f"/v1/responses/{rid}").status_code == 200 for rid in ids]
    assert kept[-1] and not kept[0]
    assert kept == sorted(kept), kept  # the newest are the ones kept
    db = sqlite3.connect(bounded.tmp / "state" / "responses.sqlite3")
    try:
        (stored,) = db.execute("SELECT sum(length(input_items) + length(messages) + "
                               "coalesce(length(output_text), 0)) FROM responses").fetchone()
    finally:
        db.close()
    assert stored <= STORE_BYTES, stored


def test_a_background_response_the_daemon_stops_for_is_stored_with_what_it_had(
        tmp_path: Path) -> None:
    """The daemon stops (SIGTERM, its drain over) with a background response under way: the
    store keeps what it had generated, as incomplete with its usage, and the stream that
    followed it ended saying the same; the next daemon serves it so."""
    server = start_server(tmp_path, ["--model", "sim:10", "--drain-timeout-s", "0.3"])
    try:
        with server.client() as c:
            rid = c.post("/v1/responses", json={"input": "go", "background": True,
                                                **LONG}).json()["id"]
            wait_for(lambda: len(_text(c.get(f"/v1/responses/{rid}").json())) > 20, 60,
                     "some text")
        server.daemon.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert server.daemon.wait(30) == 0  # type: ignore[union-attr]
        events: list[dict[str, Any]] = []  # the run this proxy followed, replayed
        collect_events(server.url, "GET", f"/v1/responses/{rid}?stream=true", events)
        assert events[-1]["type"] == "response.incomplete", events[-1]
        server.start_daemon()
        server.wait_health(200)
        stored = _wait_ended(server, rid)
        assert stored["status"] == "incomplete" and stored["error"] is None, stored
        assert stored["incomplete_details"] == {"reason": None}
        assert len(_text(stored)) > 20 and stored["usage"]["output_tokens"] > 0
        assert stored["usage"]["output_tokens"] < LONG["max_output_tokens"]
        with openai.OpenAI(base_url=server.url + "/v1", api_key="none") as client:
            assert client.responses.retrieve(rid).status == "incomplete"
    finally:
        server.stop()
