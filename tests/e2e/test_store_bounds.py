"""The Responses store's work is bounded whatever a client sends (issue 34, items 13, 14, 18), on
`tether serve` (the launcher, its daemon and proxy) with `sim:20`: beside each attack a
bystander's chat stream never waits a second for its next event, and no process is replaced.

- a conversation holding tens of megabytes: a turn on it is refused before it is read, naming
  the bound, and its items are listed a page of bounded bytes at a time;
- a request of item references is one store operation, bounded in number (a 400 naming it) and
  in what it resolves to (a 413 naming the frame, never a 500);
- many clients appending megabytes at once, and bodies of more input items than allowed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from ipc.framing import MAX_FRAME_BYTES
from proxy.responses.input_items import MAX_INPUT_ITEMS
from proxy.responses.item_references import MAX_REFERENCES
from tests.support.serve import Serve
from tests.support.streams import Paced
from tests.support.wait import at_once, free_port, wait_for

pytestmark = pytest.mark.timeout(600)

BIG = 3_900_000  # under the 4 MiB body bound, as the attacks sent them
ITEMS = 16
# What the guarantee allows a bystander's stream between two events (sim:20: one every 20 ms).
MAX_GAP_S = 1.0
CONTEXT_BYTES = 32768 * len("<|im_start|>")  # sim's context, its longest token


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("store-bounds"), free_port(),
              extra=["--model", "sim:20", "--max-num-seqs", "8"])
    try:
        s.wait_ready()
        wait_for(lambda: s.health() == 200, 60, "/health 200")
        yield s
    finally:
        s.proc.terminate()
        s.proc.wait(60)


def _client(serve: Serve) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{serve.port}", timeout=120.0)


def _beside_a_stream(serve: Serve, attack: Callable[[], Any]) -> Any:
    """Runs `attack` beside a bystander's stream: the stream's longest wait stays under
    MAX_GAP_S and the launcher's children are the ones it had."""
    pids = {name: proc.pid for name, proc in serve.children().items()}
    stream = Paced(f"http://127.0.0.1:{serve.port}").start()
    started = time.monotonic()
    try:
        result = attack()
        gap = stream.longest_gap(started)
    finally:
        stream.stop()
    assert gap < MAX_GAP_S, f"the bystander waited {gap:.2f} s for an event"
    assert {name: proc.pid for name, proc in serve.children().items()} == pids
    return result


def _append(serve: Serve, cid: str, text: str) -> httpx.Response:
    with _client(serve) as c:
        return c.post(f"/v1/conversations/{cid}/items",
                      json={"items": [{"role": "user", "content": text}]})


def test_a_conversation_of_megabytes_is_refused_unread_and_listed_in_bounded_pages(
        serve: Serve) -> None:
    with _client(serve) as c:
        cid = c.post("/v1/conversations", json={}).json()["id"]
    for i in range(ITEMS):  # the attack's 60 appends in miniature, far past the context
        assert _append(serve, cid, chr(ord("a") + i) * BIG).status_code == 200
    daemon = serve.children()["daemon"]

    def attack() -> tuple[httpx.Response, float, list[dict[str, Any]]]:
        with _client(serve) as c:
            before = sum(daemon.cpu_times()[:2])
            turn = c.post("/v1/responses", json={"conversation": cid, "input": "hi",
                                                 "max_output_tokens": 4})
            spent = sum(daemon.cpu_times()[:2]) - before
            pages, after = [], None
            while True:
                r = c.get(f"/v1/conversations/{cid}/items",
                          params={"limit": 20, "order": "asc", **({"after": after} if after
                                                                  else {})})
                assert r.status_code == 200, r.text[:300]
                pages.append(r.json())
                assert len(r.content) < MAX_FRAME_BYTES
                if not r.json()["has_more"]:
                    return turn, spent, pages
                after = r.json()["last_id"]

    turn, spent, pages = _beside_a_stream(serve, attack)
    assert turn.status_code == 400, turn.text[:300]
    error = turn.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "conversation")
    assert str(CONTEXT_BYTES) in error["message"] and str(ITEMS * BIG + 2) in error["message"]
    # Refused unread: the daemon's CPU for the turn (and the stream's ticks meanwhile) is far
    # from what reading and rendering 62 MB costs (measured: 0.38 s; tokenizing it, more).
    assert spent < 0.2, f"the turn cost the daemon {spent:.2f} s of CPU"
    texts = [item["content"][0]["text"][0] for page in pages for item in page["data"]]
    assert texts == [chr(ord("a") + i) for i in range(ITEMS)]


def test_item_references_are_one_bounded_operation(serve: Serve) -> None:
    """Four clients looping requests of the most references allowed cost another client's GET
    nothing; more references are a 400 naming the bound, and references whose items outgrow
    the pipe's frame a 413 naming it."""
    with _client(serve) as c:
        for item in ({"role": "user", "content": "x" * 4_000, "id": "words"},
                     {"role": "user", "content": '"' * 15_000, "id": "quotes"}):  # 30 KB as JSON
            r = c.post("/v1/responses", json={"input": [item], "max_output_tokens": 1})
            assert r.status_code == 200, r.text[:300]
        rid = r.json()["id"]
    stop = threading.Event()

    def flood(_: int) -> set[int]:
        statuses = set()
        refs = [{"type": "item_reference", "id": "words"}] * MAX_REFERENCES
        with _client(serve) as c:
            while not stop.is_set():
                statuses.add(c.post("/v1/responses", json={"input": refs}).status_code)
        return statuses

    def attack() -> tuple[list[set[int]], list[int]]:
        flooders = threading.Thread(target=lambda: floods.extend(at_once(4, flood)))
        flooders.start()
        gets = []
        with _client(serve) as c:
            for _ in range(30):
                gets.append(c.get(f"/v1/responses/{rid}").status_code)
        stop.set()
        flooders.join(120)
        return floods, gets

    floods: list[set[int]] = []
    floods, gets = _beside_a_stream(serve, attack)
    assert gets == [200] * 30
    assert set().union(*floods) == {400}  # each past the context, refused before tokenizing
    refs = [{"type": "item_reference", "id": "quotes"}] * MAX_REFERENCES
    with _client(serve) as c:
        many = c.post("/v1/responses", json={"input": refs * 6})  # the 600
        assert many.status_code == 400 and many.json()["error"]["param"] == "input"
        assert str(MAX_REFERENCES) in many.json()["error"]["message"]
        # A body near the bound of quotes (each twice its size once escaped), and the items:
        # as the daemon would be sent it, more than a frame.
        body = {"input": [{"role": "user", "content": '"' * 1_900_000}, *refs]}
        huge = c.post("/v1/responses", json=body)
        assert huge.status_code == 413, huge.text[:300]
        assert str(MAX_FRAME_BYTES) in huge.json()["error"]["message"]


def test_many_clients_appending_megabytes_cost_a_stream_nothing(serve: Serve) -> None:
    with _client(serve) as c:
        cid = c.post("/v1/conversations", json={}).json()["id"]

    def appender(i: int) -> list[int]:
        return [_append(serve, cid, str(i) * BIG).status_code for _ in range(3)]

    statuses = _beside_a_stream(serve, lambda: at_once(8, appender))
    assert statuses == [[200] * 3] * 8
    with _client(serve) as c:
        page = c.get(f"/v1/conversations/{cid}/items", params={"limit": 1}).json()
    assert page["has_more"]


def test_bodies_of_more_input_items_than_allowed_cost_a_stream_nothing(serve: Serve) -> None:
    item = b'{"role":"user","content":""}'
    body = b'{"input":[' + b",".join([item] * 138_000) + b'],"max_output_tokens":1}'

    def post(_: int) -> httpx.Response:
        with _client(serve) as c:
            return c.post("/v1/responses", content=body,
                          headers={"content-type": "application/json"})

    for r in _beside_a_stream(serve, lambda: at_once(4, post)):
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == "input"
        assert str(MAX_INPUT_ITEMS) in r.json()["error"]["message"]


def test_the_daemon_said_nothing_it_should_not(serve: Serve) -> None:
    """Last: no traceback and no lost connection in either process's log."""
    log = serve.log()
    assert "Traceback" not in log and "proxy lost" not in log and "daemon lost" not in log

