"""A response store on a filesystem that is really full (a small tmpfs, filled to the last byte):
every client still gets its ending, the daemon lives, nobody else notices, and the store serves
again once there is room."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.metrics import m
from tests.support.pair import (
    CHAT,
    Server,
    assert_baseline,
    drop,
    post_raw,
    start_server,
    wait_aborts,
)
from tests.support.raw_http import read_events, read_to_end, response_id_from_stream, sse_json
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

# Long enough to outlast filling the disk, short enough to finish soon after.
LONG = {"max_output_tokens": 600, "ignore_eos": True, "temperature": 0}


class Disk:
    """A 4 MiB tmpfs; `fill` takes every free byte, `free` gives them back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        chunk = b"\0" * 65536
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    os.write(fd, chunk[: 4096 if os.fstat(fd).st_size % 65536 else 65536])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        return
                    chunk = chunk[: len(chunk) // 2]  # down to the last byte
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    state = tmp_path / "state"  # where the harness points --state-dir
    state.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs",
                              str(state)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full filesystem needs a tmpfs mount (root): {mounted.stderr.strip()}")
    try:
        yield Disk(state)
    finally:
        subprocess.run(["umount", "--lazy", str(state)], check=False)


def _events(raw: bytes) -> list[dict]:
    text = raw.decode(errors="replace")
    return [e for e in map(sse_json, text.splitlines()) if e is not None]


def test_a_full_disk_costs_each_response_alone(disk: Disk, tmp_path: Path) -> None:
    server = start_server(tmp_path, ["--max-num-seqs", "8"])
    try:
        _scenario(server, disk)
    finally:
        server.stop()


def _scenario(server: Server, disk: Disk) -> None:
    with server.client() as c:
        stored = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4,
                                               "ignore_eos": True}).json()
        assert c.get(f"/v1/responses/{stored['id']}").json()["status"] == "incomplete"
    daemon_pid = server.daemon.pid if server.daemon else None
    bystander = post_raw(server, "/v1/chat/completions", {**CHAT, "max_tokens": 800,
                                                          "stream": True})
    finishing = post_raw(server, "/v1/responses", {"input": "go on", "stream": True, **LONG})
    leaving = post_raw(server, "/v1/responses", {"input": "and on", "stream": True, **LONG})
    read_events(bystander, 2)
    rid = response_id_from_stream(read_events(finishing, 6))
    read_events(leaving, 6)
    before = server.metrics()
    assert m(before, "tether_conversation_placeholders") == 2

    disk.fill()
    drop(leaving)  # its placeholder cannot be removed: the abort must still go through
    after_drop = wait_aborts(server, "client_disconnect",
                             m(before, "tether_aborts_total", cause="client_disconnect") + 1)
    assert m(after_drop, "tether_conversation_placeholders") == 1

    # The response that finishes while the disk is full gets its ending, which says why.
    events = _events(read_to_end(finishing))
    assert events[-1]["type"] == "response.failed", events[-3:]
    error = events[-1]["response"]["error"]["message"]
    assert "could not be stored" in error and "full" in error
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")

    with server.client() as c:
        refused = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})
        assert refused.status_code == 500 and refused.json()["error"]["code"] == "store_error"
        unstored = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4,
                                                 "store": False})
        assert unstored.status_code == 200 and unstored.json()["status"] == "incomplete"

    # Nobody else noticed.
    tail = read_to_end(bystander).decode(errors="replace")
    assert "data: [DONE]" in tail and '"finish_reason":"length"' in tail
    wait_for(lambda: m(server.metrics(), "tether_requests_running") == 0, 30, "idle")
    end = server.metrics()
    assert_baseline(end)
    assert m(end, "tether_requests_finished_total", reason="error") == m(
        before, "tether_requests_finished_total", reason="error") + 1
    assert server.daemon is not None and server.daemon.poll() is None
    assert server.daemon.pid == daemon_pid
    log = (server.tmp / "daemon.log").read_text(errors="replace")
    assert f"could not store the result of response {rid}" in log
    assert "Traceback" not in log and "engine step failed" not in log

    disk.free()  # room again: the same daemon stores as before
    with server.client() as c:
        later = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4,
                                              "ignore_eos": True}).json()
        assert c.get(f"/v1/responses/{later['id']}").json()["status"] == "incomplete"
        assert isinstance(c.get("/health"), httpx.Response)
