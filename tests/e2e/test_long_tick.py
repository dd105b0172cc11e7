"""Liveness does not depend on how long a tick takes: a multi-second prefill tick on builtin:small
is not mistaken for a hung daemon, and the streams beside it carry on."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.support.metrics import m
from tests.support.pair import start_server, wait_running
from tests.support.streams import STREAM, Bystanders

pytestmark = pytest.mark.timeout(400)


def test_a_long_prefill_tick_is_not_a_lost_daemon(tmp_path: Path) -> None:
    server = start_server(tmp_path, ["--model", "builtin:small", "--max-num-seqs", "8",
                                     "--max-tokens-per-tick", "2048"])
    try:
        others = Bystanders(server.url, 3, body={"prompt": "beside it", **STREAM,
                                                 "max_tokens": 48}).start()
        wait_running(server, 3)
        answer: dict[str, object] = {}

        def long_prefill() -> None:
            # ~2,000 tokens in one chunk: one tick of several seconds on 2 CPU cores.
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"prompt": "tick " * 399, "max_tokens": 4, "ignore_eos": True})
            answer.update(status=r.status_code, body=r.text)

        thread = threading.Thread(target=long_prefill)
        thread.start()
        thread.join(300)
        assert answer.get("status") == 200, answer
        others.assert_all_ok()
        after = server.metrics()
        assert m(after, "tether_aborts_total", cause="proxy_lost") == 0
        assert "daemon lost" not in server.log("proxy")
        assert "proxy lost" not in server.log("daemon")
    finally:
        server.stop()
