"""Two real pairs behind the real smg router, sharing a real PostgreSQL store."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from daemon.responses.watcher import OWNER_LOST_MESSAGE
from tests.support.cluster import MODEL, RoutedCluster
from tests.support.metrics import m
from tests.support.pair import CHAT, LONG, check_abort_figures, wait_aborts
from tests.support.postgres import Postgres
from tests.support.raw_http import post_raw, read_events
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

BACKGROUND = {"model": MODEL, "input": "keep going", "background": True, "max_output_tokens": 1500,
              "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoutedCluster]:
    c = RoutedCluster(tmp_path_factory.mktemp("cluster"), postgres.new_schema())
    try:
        c.start()
        yield c
    finally:
        c.stop()


def totals(metrics: dict[str, float]) -> tuple[float, float, float]:
    aborts = sum(v for k, v in metrics.items() if k.startswith("tether_aborts_total"))
    finished = sum(v for k, v in metrics.items() if k.startswith("tether_requests_finished_total"))
    return aborts, finished, m(metrics, "tether_generation_tokens_total")


def owner_of_one_running(cluster: RoutedCluster) -> int:
    wait_for(lambda: sum(cluster.running()) == 1, 60, "one request running")
    return cluster.running().index(1)


def test_disconnect_through_the_router_evicts_on_the_owner_only(cluster: RoutedCluster) -> None:
    sock = post_raw(cluster.port, "/v1/chat/completions", {**CHAT, "model": MODEL, "stream": True})
    read_events(sock, 3)
    owner = owner_of_one_running(cluster)
    other = cluster.replicas[1 - owner]
    before, other_before = cluster.replicas[owner].metrics(), other.metrics()
    closed = time.monotonic()
    sock.close()
    after = check_abort_figures(cluster.replicas[owner], before)
    # The router's hop: the client's close reaches the owner as a disconnect at once.
    assert time.monotonic() - closed < 5.0  # generous; the bound asserted is the tick count
    within = (m(after, "tether_abort_latency_seconds_bucket", le="0.1")
              - m(before, "tether_abort_latency_seconds_bucket", le="0.1"))
    assert within == 1, "the owner's proxy saw the disconnect and evicted within 100 ms"
    assert totals(other.metrics()) == totals(other_before)


def test_a_killed_daemon_ends_its_streams_and_the_router_routes_around(
        cluster: RoutedCluster) -> None:
    socks = [post_raw(cluster.port, "/v1/chat/completions", {**CHAT, "model": MODEL, "stream": True})
             for _ in range(2)]
    for s in socks:
        read_events(s, 2)
    wait_for(lambda: cluster.running() == [1, 1], 60, "one stream on each replica")
    try:
        cluster.replicas[0].kill("daemon")
        ended = [_ends_with_error(s) for s in socks]
        assert sorted(ended) == [False, True], "exactly the killed replica's stream errs"
        for s in socks:
            s.close()
        with cluster.client() as client:
            codes = [client.post("/v1/completions", json={"model": MODEL, "prompt": f"after {i}",
                                                          "max_tokens": 4}).status_code
                     for i in range(10)]
        assert codes == [200] * 10, codes
    finally:
        cluster.restart_daemon(0)


def _ends_with_error(sock: Any, wait_s: float = 5.0) -> bool:
    """Whether the stream ends with an error event within `wait_s` (a live one keeps going)."""
    sock.settimeout(0.5)
    got = b""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        got += chunk
        if b'"error"' in got:
            return True
    return False


def test_responses_through_the_router_whichever_replica_is_picked(
        cluster: RoutedCluster) -> None:
    served = [cluster.finished(i) for i in range(2)]
    direct = [r.client() for r in cluster.replicas]
    with cluster.client() as router:
        for i in range(20):
            first = router.post("/v1/responses", json={"model": MODEL, "input": f"I am user {i}.",
                                                       "max_output_tokens": 4})
            assert first.status_code == 200, first.text
            rid = first.json()["id"]
            second = router.post("/v1/responses", json={
                "model": MODEL, "input": "Who am I?", "max_output_tokens": 4,
                "previous_response_id": rid})
            assert second.status_code == 200, second.text
            rid2 = second.json()["id"]
            # Reads and deletes go to a replica (smg answers them from its own history layer):
            # any replica, since they share the store.
            got = direct[i % 2].get(f"/v1/responses/{rid2}")
            assert got.status_code == 200 and got.json()["previous_response_id"] == rid
            items = direct[(i + 1) % 2].get(f"/v1/responses/{rid2}/input_items")
            assert items.status_code == 200
            assert [x["content"][0]["text"] for x in items.json()["data"]] == ["Who am I?"]
            assert direct[(i + 1) % 2].delete(f"/v1/responses/{rid}").status_code == 200
            assert direct[i % 2].get(f"/v1/responses/{rid}").status_code == 404
        # Pinned so that a change in smg shows up here: it does not forward these reads.
        assert router.get(f"/v1/responses/{rid2}").status_code == 404
    for c in direct:
        c.close()
    assert all(cluster.finished(i) - served[i] >= 10 for i in range(2)), "both replicas served"


def _start_background(server: Any) -> str:
    with server.client() as client:
        r = client.post("/v1/responses", json=BACKGROUND)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _status(server: Any, rid: str) -> dict[str, Any]:
    with server.client() as client:
        r = client.get(f"/v1/responses/{rid}")
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("via", ["other replica", "router"])
def test_background_cancelled_elsewhere_is_evicted_by_its_owner(cluster: RoutedCluster,
                                                                via: str) -> None:
    owner, other = cluster.replicas
    before = owner.metrics()
    rid = _start_background(owner)
    wait_for(lambda: cluster.running()[0] == 1, 60, "the background response running")
    if via == "router":
        cancel = httpx.post(f"{cluster.url}/v1/responses/{rid}/cancel", timeout=30.0)
    else:
        with other.client() as client:
            cancel = client.post(f"/v1/responses/{rid}/cancel")
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text
    after = wait_aborts(owner, "cancel", m(before, "tether_aborts_total", cause="cancel") + 1)
    assert m(after, "tether_requests_running") == 0
    assert m(after, "tether_conversation_placeholders") == 0
    assert _status(owner, rid)["status"] == _status(other, rid)["status"] == "cancelled"


def test_a_dead_owners_background_response_is_failed_by_the_other(cluster: RoutedCluster) -> None:
    owner, other = cluster.replicas[1], cluster.replicas[0]
    rid = _start_background(owner)
    wait_for(lambda: cluster.running()[1] == 1, 60, "the background response running")
    try:
        owner.kill("daemon")
        wait_for(lambda: _status(other, rid)["status"] == "failed", 30,
                 "the other replica ending the dead owner's response")
        assert _status(other, rid)["error"]["message"] == OWNER_LOST_MESSAGE
    finally:
        cluster.restart_daemon(1)


def test_a_restarted_replica_serves_everything_stored(cluster: RoutedCluster) -> None:
    with cluster.client() as router:
        ids = [router.post("/v1/responses", json={"model": MODEL, "input": f"remember {i}",
                                                  "max_output_tokens": 4}).json()["id"]
               for i in range(4)]
    replica = cluster.replicas[0]
    replica.stop()
    replica.start_daemon()
    replica.start_proxy()
    replica.wait_health(200)
    with replica.client() as client:
        for rid in ids:
            assert client.get(f"/v1/responses/{rid}").status_code == 200
            chained = client.post("/v1/responses", json={
                "input": "again", "max_output_tokens": 4, "previous_response_id": rid})
            assert chained.status_code == 200, chained.text
    cluster.wait_routed()


def test_long_background_body_is_a_tether_extension(cluster: RoutedCluster) -> None:
    """smg validates Responses bodies strictly: tether's sampling extensions reach a replica only
    when sent to it directly (chat and completions accept them through smg)."""
    refused = httpx.post(f"{cluster.url}/v1/responses", json={**BACKGROUND, "background": False,
                                                               "max_output_tokens": 2},
                         timeout=30.0)
    assert refused.status_code in (400, 422) and "ignore_eos" in refused.text
    chat = httpx.post(f"{cluster.url}/v1/chat/completions",
                      json={**CHAT, **LONG, "model": MODEL, "max_tokens": 3}, timeout=30.0)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3


def test_two_replicas_share_a_conversation_one_turn_at_a_time(cluster: RoutedCluster) -> None:
    """Made on one replica, continued on the other; a background turn running on one makes a turn
    on the other a 409, and cancelled from the other it appends nothing."""
    one, two = (r.client() for r in cluster.replicas)
    conv = one.post("/v1/conversations", json={"items": [
        {"type": "message", "role": "user", "content": "hello"}]}).json()["id"]
    turn = two.post("/v1/responses", json={"input": "on two", "conversation": conv,
                                           "max_output_tokens": 4})
    assert turn.status_code == 200, turn.text

    def texts(client: httpx.Client) -> list[str]:
        items = client.get(f"/v1/conversations/{conv}/items", params={"order": "asc"}).json()
        return [x["content"][0]["text"] for x in items["data"]]

    seen = texts(one)
    assert seen[:2] == ["hello", "on two"] and len(seen) == 3 and seen == texts(two)
    running = one.post("/v1/responses", json={**BACKGROUND, "conversation": conv}).json()["id"]
    wait_for(lambda: cluster.running()[0] == 1, 60, "the background turn running")
    busy = two.post("/v1/responses", json={"input": "meanwhile", "conversation": conv,
                                           "max_output_tokens": 4})
    assert busy.status_code == 409 and running in busy.text, busy.text
    assert two.post(f"/v1/responses/{running}/cancel").json()["status"] == "cancelled"
    wait_for(lambda: cluster.running()[0] == 0, 30, "the owner evicting the cancelled turn")
    assert texts(two) == seen
    after = two.post("/v1/responses", json={"input": "after", "conversation": conv,
                                            "max_output_tokens": 4})
    assert after.status_code == 200, after.text
    assert two.delete(f"/v1/conversations/{conv}").status_code == 200
    assert one.get(f"/v1/conversations/{conv}").status_code == 404
    one.close()
    two.close()
